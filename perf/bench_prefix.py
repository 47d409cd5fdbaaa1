"""Prefix-cache benchmark on the embedded SmolLM2-135M-Instruct (fp32, CPU threads configurable).

For each prompt length it measures, side by side in one process: time to first token without
reuse; with reuse on a repeated prompt; on a middle edit (first request and repeated); and the
decode rate with reuse off and on. Every reused answer is checked against its no-reuse
reference (same tokens, bitwise-equal first logits).

    .venv/bin/python perf/bench_prefix.py --quick          # 2K only
    .venv/bin/python perf/bench_prefix.py                  # 2K, 4K, 8K
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pckernels.integration.embedded import load_model, load_tokenizer
from pckernels.prefix import DEFAULT_BLOCK_SIZE, PrefixCache


def document_ids(tokenizer, num_tokens: int) -> list[int]:
    """A chat prompt of exactly ``num_tokens`` tokens: a long system document and a question."""
    paragraphs = " ".join(
        f"Record {i}: the station at grid {i * 37 % 101} measured {i * 13 % 47} mm of rain and a wind of "
        f"{i * 7 % 29} knots from bearing {i * 53 % 360}; the observer noted {['fog', 'hail', 'clear sky'][i % 3]}."
        for i in range(num_tokens // 20)
    )
    question = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which record had the strongest wind?"}], add_generation_prompt=True,
        tokenize=False)
    question_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    head = tokenizer("<|im_start|>system\n" + paragraphs, add_special_tokens=False)["input_ids"]
    end = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    body = num_tokens - len(question_ids) - len(end)
    if len(head) < body:
        raise ValueError(f"document too short for {num_tokens} tokens")
    return head[:body] + end + question_ids


def timed(cache: PrefixCache, ids: list[int], reuse: bool, decode_tokens: int):
    result = cache.complete(ids, max_new_tokens=decode_tokens, reuse=reuse)
    decode_rate = (len(result.token_ids) - 1) / max(result.total_s - result.ttft_s, 1e-9)
    return result, decode_rate


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits)


def bench_size(cache: PrefixCache, tokenizer, num_tokens: int, decode_tokens: int, repeats: int) -> dict:
    """Best of ``repeats`` interleaved rounds (the store is cleared before each round)."""
    ids = document_ids(tokenizer, num_tokens)
    edited = list(ids)
    middle = num_tokens // 2
    edited[middle] = ids[middle + 1] if ids[middle] != ids[middle + 1] else 13
    times: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    exact = True
    for _ in range(repeats):
        cache.clear()
        runs = {}
        for name, prompt, reuse in [("no_reuse", ids, False), ("first_pass_reuse", ids, True),
                                    ("repeat", ids, True), ("edit_no_reuse", edited, False),
                                    ("edit_first", edited, True), ("edit_repeat", edited, True)]:
            runs[name], rate = timed(cache, prompt, reuse, decode_tokens)
            times.setdefault(name, []).append(runs[name].ttft_s)
            if name in ("no_reuse", "repeat"):
                rates["off" if name == "no_reuse" else "on"].append(rate)
        exact &= all([same(runs["no_reuse"], runs["first_pass_reuse"]), same(runs["no_reuse"], runs["repeat"]),
                      same(runs["edit_no_reuse"], runs["edit_first"]),
                      same(runs["edit_no_reuse"], runs["edit_repeat"])])
    row = {"tokens": num_tokens, "edit_cached_tokens": runs["edit_first"].cached_tokens, "exact": exact,
           "store_bytes": cache.stats()["bytes"]}
    row.update({f"ttft_{name}_s": min(values) for name, values in times.items()})
    row.update({f"decode_tok_s_{mode}": max(values) for mode, values in rates.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--quick", action="store_true", help="2K tokens only")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds; the best is reported")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [2048] if args.quick else args.sizes

    model, tokenizer = load_model(), load_tokenizer()
    cache = PrefixCache(model, tokenizer, block_size=args.block_size, budget_bytes=int(args.budget_gib * 2**30))
    cache.complete(document_ids(tokenizer, 300), max_new_tokens=2, reuse=False)  # warm-up
    rows = []
    for num_tokens in sizes:
        started = time.perf_counter()
        rows.append(bench_size(cache, tokenizer, num_tokens, args.decode_tokens, args.repeats))
        print(f"# {num_tokens} tokens measured in {time.perf_counter() - started:.0f} s", flush=True)

    print(f"\nSmolLM2-135M fp32, {args.threads} threads, block {args.block_size}, "
          f"{args.decode_tokens} decoded tokens, best of {args.repeats} interleaved rounds\n")
    print("| Prompt | First token, no reuse | Repeat | Middle edit, first | Middle edit, repeated "
          "| Decode tok/s off / on | Exact |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = r["ttft_no_reuse_s"]
        print(f"| {r['tokens'] // 1024}K | {base:.2f} s "
              f"| {r['ttft_repeat_s'] * 1e3:.1f} ms (1/{base / r['ttft_repeat_s']:.0f}) "
              f"| {r['ttft_edit_first_s']:.2f} s ({r['ttft_edit_first_s'] / base:.2f}x) "
              f"| {r['ttft_edit_repeat_s'] * 1e3:.1f} ms "
              f"| {r['decode_tok_s_off']:.1f} / {r['decode_tok_s_on']:.1f} "
              f"| {'yes' if r['exact'] else 'NO'} |")
    print("\nEdited prompt without reuse: "
          + ", ".join(f"{r['tokens'] // 1024}K {r['ttft_edit_no_reuse_s']:.2f} s" for r in rows))
    print("First pass with reuse on (stores blocks): "
          + ", ".join(f"{r['tokens'] // 1024}K {r['ttft_first_pass_reuse_s']:.2f} s" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
