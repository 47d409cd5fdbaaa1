"""CPU time per token of a streamed answer with stop strings, first hundred tokens against the last.

``python -m perf.bench_stream`` feeds a fixed 2,000-token answer (SmolLM2's tokenizer: English,
CJK, emoji, code) through the two places that turn tokens into text while an answer streams: the
engine's :class:`~pckernels.generation.TokenChoice` (``choose``: picks the token from one-hot
logits and checks the stop strings) and the caller's :class:`~pckernels.generation.TextStream`
(``push``: the text delta to send), with two stop strings that never occur. It reports the CPU time
(``time.thread_time_ns``) per token for tokens 1-100 and 1901-2000, best of ``--repeats`` per
token. Only APIs that also existed before the streamed text became incremental are used, so the
same script measures an older checkout: ``PYTHONPATH=/path/to/checkout python -m perf.bench_stream``.

``--real N`` also streams an ``N``-token answer of the embedded model (end-of-sequence banned by
logit bias, the same two stop strings) and reports, per token, the CPU time of ``TokenChoice.choose``
on the scheduler thread and of ``TextStream.push`` on the caller's thread (the forwards excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

STOPS = ["<|END|>", "\n\n\n\n"]
PARTS = ["The harbour lights came on one by one, and the tide ", "東京の夜景はとても美しいです。", " 🎉🙂 ",
         "def area(r):\n    return 3.14159 * r ** 2  # 円の面積\n", "Ünïcödé “quotes” — and more words. "]


def answer_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    k = 0
    while len(ids) < n:
        ids += tokenizer.encode(PARTS[k % len(PARTS)], add_special_tokens=False)
        k += 1
    return ids[:n]


def one_pass(tokenizer, ids: list[int]) -> tuple[list[int], list[int], str]:
    """Per-token CPU ns of ``choose`` and of ``push`` over ``ids``; the streamed text."""
    import torch

    from pckernels.generation import SamplingParams, TextStream, TokenChoice

    params = SamplingParams.of(len(ids), 0.0, 1.0, STOPS, None)
    choice = TokenChoice(params, tokenizer, set())
    stream = TextStream(tokenizer, STOPS)
    logits = torch.full((len(tokenizer),), -1e9)
    choose, push, deltas = [], [], []
    for position, token in enumerate(ids):
        logits[token] = 0.0
        start = time.thread_time_ns()
        got = choice.choose(logits, position)
        middle = time.thread_time_ns()
        deltas.append(stream.push([got]))
        end = time.thread_time_ns()
        logits[token] = -1e9
        choose.append(middle - start)
        push.append(end - middle)
    result = choice.result([], [], cached_tokens=0, computed_tokens=0, mode="bench")
    deltas.append(stream.finish(result.text))
    assert "".join(deltas) == result.text
    return choose, push, result.text


def summary(per_token: list[int]) -> dict:
    first, last = per_token[:100], per_token[-100:]
    return {"first100_us": round(statistics.fmean(first) / 1e3, 1), "last100_us": round(statistics.fmean(last) / 1e3, 1),
            "ratio": round(statistics.fmean(last) / statistics.fmean(first), 2)}


def fixed(tokenizer, n: int, repeats: int) -> dict:
    ids = answer_ids(tokenizer, n)
    runs = [one_pass(tokenizer, ids) for _ in range(repeats)]
    text = runs[0][2]
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    choose = [min(r[0][i] for r in runs) for i in range(n)]
    push = [min(r[1][i] for r in runs) for i in range(n)]
    both = [c + p for c, p in zip(choose, push)]
    return {"tokens": n, "chars": len(text), "choose": summary(choose), "push": summary(push), "total": summary(both)}


def real(tokenizer, n: int) -> dict:
    """An ``n``-token answer of the embedded model, streamed; per-token CPU of choose and push."""
    import torch

    from pckernels.engine import PromptCache
    from pckernels.generation import TextStream
    from pckernels.generation import choice as choice_mod
    from pckernels.integration.embedded import load_model

    chosen: list[int] = []
    original = choice_mod.TokenChoice.choose

    def timed(self, logits, next_position):
        start = time.thread_time_ns()
        token = original(self, logits, next_position)
        chosen.append(time.thread_time_ns() - start)
        return token

    choice_mod.TokenChoice.choose = timed
    cache = PromptCache(load_model(dtype=torch.float32), tokenizer, store_dir=False)
    try:
        ban = {i: -100.0 for i in cache.eos_ids}
        messages = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]
        request = cache.complete_request(messages, max_new_tokens=n, temperature=0.0, stop=STOPS, logit_bias=ban)
        handle = cache.submit(request)
        stream = TextStream(tokenizer, STOPS)
        push, deltas = [], []
        started = time.perf_counter()
        for token in handle:
            start = time.thread_time_ns()
            deltas.append(stream.push([token]))
            push.append(time.thread_time_ns() - start)
        result = handle.result()
        deltas.append(stream.finish(result.text))
        wall = time.perf_counter() - started
    finally:
        choice_mod.TokenChoice.choose = original
        cache.close()
    assert "".join(deltas) == result.text
    n_out = len(result.token_ids)
    return {"tokens": n_out, "finish_reason": result.finish_reason, "wall_s": round(wall, 1),
            "choose": summary(chosen[-n_out:]), "push": summary(push)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_stream", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--real", type=int, default=0, metavar="N", help="also stream N tokens of the embedded model")
    args = ap.parse_args(argv)
    import pckernels
    from pckernels.integration.embedded import load_tokenizer

    tokenizer = load_tokenizer()
    out = {"package": pckernels.__file__, "stops": STOPS, "fixed": fixed(tokenizer, args.tokens, args.repeats)}
    if args.real:
        out["real"] = real(tokenizer, args.real)
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
