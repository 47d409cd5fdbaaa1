"""TTFT of the engine on the embedded model: baseline vs Prompt Cache vs the floor.

For each cached length (default 1K, 2K, 4K tokens) a schema holds one document module of that
many tokens; the prompt imports it and asks a 32-token question. Measured side by side in one
run, ``--repeats`` times each, median and spread reported:

* baseline: plain prefill of the whole prompt (no reuse);
* cached (warm): Prompt Cache when the document's KV is already in the assembly buffer at its rows;
* cached (cold): Prompt Cache after the buffer was invalidated, so every block is copied in;
* floor: only the forward of the question over the resident cache (no parse, no assembly).

    python perf/bench_engine.py [--lengths 1024 2048 4096] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from pckernels.engine import PromptCache

FILLER = ("The archive records how the valley towns traded wool, salt and timber across the mountain passes. "
          "Each season the council counted the carts, the bridges were repaired, and the river mills ground "
          "barley for the winter stores. ")
QUESTION = ("Based on the archive above, which goods did the valley towns trade across the passes, and what did "
            "the mills grind?")


def document_text(tokenizer, n_tokens: int) -> str:
    ids = tokenizer(FILLER * (n_tokens // 20 + 10), add_special_tokens=False).input_ids[:n_tokens]
    return tokenizer.decode(ids)


def floor_seconds(cache: PromptCache, prompt: str) -> float:
    """Time one forward of the prompt's uncached tokens over blocks already resident in the buffer."""
    from pckernels.engine.plan import plan_cached

    resolved = cache.resolve(prompt)
    plan = plan_cached(resolved)
    cache.generate(resolved, max_new_tokens=1)
    ids = torch.tensor([plan.new_tokens], device=cache.device)
    positions = torch.tensor(plan.new_positions, device=cache.device)
    attention = cache.buffer.attention(positions, plan.rows)
    cache._cache.prepare(rows=None, start=plan.new_rows[0], extent=plan.rows)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = cache.adapter.forward(ids, positions[None], attention, cache._cache)
        int(torch.argmax(logits[-1]))
        return time.perf_counter() - t0


def measure(cache: PromptCache, n_tokens: int, repeats: int) -> dict:
    doc = document_text(cache.tokenizer, n_tokens)
    schema = cache.add_schema(f'<schema name="doc{n_tokens}"><system>Answer from the archive.\n'
                              f'<module name="archive">{doc}</module></system></schema>')
    prompt = f'<prompt schema="{schema.name}"><archive/><user>{QUESTION}</user><assistant/></prompt>'
    cache.generate(prompt, max_new_tokens=1)
    cache.generate(prompt, max_new_tokens=1, mode="baseline")
    runs: dict[str, list[float]] = {"baseline": [], "cached_warm": [], "cached_cold": [], "floor": []}
    for _ in range(repeats):
        runs["baseline"].append(cache.generate(prompt, max_new_tokens=1, mode="baseline").ttft_s)
        cache.buffer.invalidate_all()
        runs["cached_cold"].append(cache.generate(prompt, max_new_tokens=1).ttft_s)
        runs["cached_warm"].append(cache.generate(prompt, max_new_tokens=1).ttft_s)
        runs["floor"].append(floor_seconds(cache, prompt))
    result = cache.generate(prompt, max_new_tokens=1)
    out = {"cached_tokens": result.cached_tokens, "computed_tokens": result.computed_tokens}
    for name, values in runs.items():
        out[name] = {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}
    med = {k: v["median_s"] for k, v in out.items() if isinstance(v, dict)}
    out["speedup_warm"] = med["baseline"] / med["cached_warm"]
    out["speedup_cold"] = med["baseline"] / med["cached_cold"]
    out["best_possible"] = med["baseline"] / med["floor"]
    out["warm_over_floor"] = med["cached_warm"] / med["floor"]
    out["cold_over_floor"] = med["cached_cold"] / med["floor"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", type=Path, default=None, help="Write the results as JSON here.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache = PromptCache.from_pretrained(args.model)
    rows = {}
    print(f"{'cached':>7} {'baseline':>10} {'warm':>9} {'cold':>9} {'floor':>9} {'x warm':>7} {'x cold':>7} "
          f"{'x best':>7} {'warm/floor':>10} {'cold/floor':>10}")
    for n in args.lengths:
        r = measure(cache, n, args.repeats)
        rows[n] = r
        ms = {k: r[k]["median_s"] * 1e3 for k in ("baseline", "cached_warm", "cached_cold", "floor")}
        print(f"{r['cached_tokens']:>7} {ms['baseline']:>8.0f}ms {ms['cached_warm']:>7.1f}ms "
              f"{ms['cached_cold']:>7.1f}ms {ms['floor']:>7.1f}ms {r['speedup_warm']:>6.1f}x {r['speedup_cold']:>6.1f}x "
              f"{r['best_possible']:>6.1f}x {r['warm_over_floor']:>10.3f} {r['cold_over_floor']:>10.3f}", flush=True)
    if args.out:
        meta = {"machine": platform.machine(), "processor": platform.processor(), "threads": args.threads,
                "torch": torch.__version__, "device": str(cache.device), "dtype": str(cache.dtype)}
        args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
