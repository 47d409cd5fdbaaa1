"""What ``n`` answers cost: one request with ``n`` against ``n`` requests of the same prompt.

``python -m perf.bench_n`` (embedded model): a chat prompt over a document of about ``--tokens``
tokens, sampled (temperature 0.8, a seed per answer) with ``--new`` tokens per answer, asked

* ``n=N``: one request with ``n=N`` (the prompt read once; the other answers start from its states);
* ``N requests``: ``N`` requests of the same prompt submitted at once, reuse off (what a client
  without ``n`` would do against a server without a prefix cache);
* ``N requests, prefix reuse``: the same with exact prefix reuse on (the prompt read by the first,
  the others resume from its blocks; each round under a salt of its own, so it starts cold).

Timed interleaved over ``--rounds``: wall time until every answer is in, first-token time of the
slowest answer, and the prompt tokens computed. Writes ``n.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

WORDS = ("harbour", "ledger", "lantern", "orchard", "quarry", "tide", "market", "furnace", "bridge", "river")


def document(tokens: int) -> str:
    """A plain-text document of roughly ``tokens`` tokens (SmolLM2's tokenizer: ~1.3 per word)."""
    words = [f"{WORDS[i % 10]} {i * 7 % 101}" for i in range(int(tokens / 2.6))]
    return "Harbour ledger. " + ", ".join(words) + "."


def run_once(pc, messages, n: int, new: int, how: str, salt: str = "") -> dict:
    """One round: ``how`` is ``n`` (one request), ``off`` or ``prefix`` (``n`` requests); ``salt``
    keeps each round's prefix blocks apart, so every round reads the prompt cold."""
    start = time.perf_counter()
    if how == "n":
        handle = pc.submit(pc.complete_request(messages, max_new_tokens=new, temperature=0.8, seed=1, n=n,
                                               salt=salt))
        results = [choice.result() for choice in handle.choices]
    else:
        handles = [pc.submit(pc.complete_request(messages, max_new_tokens=new, temperature=0.8, seed=1 + i,
                                                 reuse=how == "prefix", salt=salt))
                   for i in range(n)]
        results = [h.result() for h in handles]
    wall = time.perf_counter() - start
    return {"wall_s": wall, "ttft_max_s": max(r.ttft_s for r in results),
            "computed": sum(r.computed_tokens for r in results), "tokens": sum(len(r.token_ids) for r in results),
            "texts": [r.text for r in results]}


def main(argv: list[str] | None = None) -> None:
    from pckernels import PromptCache

    ap = argparse.ArgumentParser(prog="python -m perf.bench_n", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("perf/results/cpu-2c/n"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pc = PromptCache.from_pretrained(store_dir=False)
    messages = [{"role": "system", "content": document(args.tokens)},
                {"role": "user", "content": "Write one short line about the harbour."}]
    prompt_tokens = len(pc.complete_request(messages).prompt_token_ids)
    hows = {"n": f"n={args.n}", "off": f"{args.n} requests", "prefix": f"{args.n} requests, prefix reuse"}
    runs: dict[str, list[dict]] = {how: [] for how in hows}
    run_once(pc, messages, args.n, 4, "off")  # warm-up
    for round_ in range(args.rounds):
        for how in hows:
            runs[how].append(run_once(pc, messages, args.n, args.new, how, salt=f"{how}-{round_}"))
    same_texts = runs["n"][0]["texts"] == runs["off"][0]["texts"] == runs["prefix"][0]["texts"]
    rows = {how: {"wall_s": statistics.median(r["wall_s"] for r in runs[how]),
                  "ttft_max_s": statistics.median(r["ttft_max_s"] for r in runs[how]),
                  "computed": runs[how][0]["computed"], "tokens": runs[how][0]["tokens"]} for how in hows}
    out = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
           "prompt_tokens": prompt_tokens, "n": args.n, "new": args.new, "rounds": args.rounds,
           "rows": rows, "same_answers": same_texts}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "n.json").write_text(json.dumps(out, indent=1))
    base = rows["n"]["wall_s"]
    lines = [f"# n answers vs n requests ({prompt_tokens}-token prompt, {args.new} tokens each, "
             f"{args.threads} threads, median of {args.rounds})", "",
             f"`python -m perf.bench_n --tokens {args.tokens} --n {args.n} --new {args.new} --rounds {args.rounds}`",
             "", "| how | all answers in | slowest first token | prompt tokens computed | x n= |", "|---|---|---|---|---|"]
    for how, label in hows.items():
        row = rows[how]
        lines.append(f"| {label} | {row['wall_s'] * 1000:.0f} ms | {row['ttft_max_s'] * 1000:.0f} ms | "
                     f"{row['computed']} | {row['wall_s'] / base:.2f}x |")
    lines += ["", f"Same sampled answers (seed i+1 for the i-th) in all three: {'yes' if same_texts else 'no'}."]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    pc.close()


if __name__ == "__main__":
    main()
