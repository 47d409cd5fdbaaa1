"""TTFT of compact placement vs schema placement, and what the re-rotation costs per token.

``python -m perf.bench_compact`` (embedded model): a RAG schema inside the system prompt whose
``--k`` long passages (``--tokens`` in all) alternate with short ones (``--filler`` tokens) the
query leaves out, so at schema placement the imported passages sit behind gaps and at compact
placement they are moved together — the blocks after the first are re-rotated while they are
copied into the arena (the first reads its packed encoding, which needs no move). For each total
it times, interleaved over ``--rounds``:

* ``schema`` / ``compact``: blocks copied from the store into the arena on every query
  (``evict_resident`` first; compact re-rotates on the way);
* ``schema_resident`` / ``compact_resident``: the blocks already in the arena (placed by the
  query before, alone: the arena holds one placement at a time, so attention reads no rows of
  the other's blocks);

and a profile of one compact query (``perf.suite.breakdown``). Beside it, the block copy alone:
``ops.gather_rotate`` vs ``ops.gather_concat`` of the same rows, per token.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from perf.suite.breakdown import profile
from perf.suite.texts import archive, pml_escape, sized

QUESTION = "Which goods did the valley towns trade across the passes, and what did the mills grind?"


def workload(tokenizer, total: int, k: int, filler: int) -> tuple[str, list[str]]:
    docs = [pml_escape(sized(tokenizer, archive(300 + i), total // k if i % 2 else filler)) for i in range(2 * k)]
    modules = "".join(f'<module name="p{i}">{d}\n</module>' for i, d in enumerate(docs))
    schema = f'<schema name="compact{total}"><system>Answer using only the passages.\n{modules}</system></schema>'
    picked = "".join(f"<p{i}/>" for i in range(1, 2 * k, 2))
    prompts = [f'<prompt schema="compact{total}" placement="{p}">{picked}<user>{QUESTION}</user><assistant/></prompt>'
               for p in ("schema", "compact")]
    return schema, prompts


def copy_seconds(layout, n: int, dtype: torch.dtype, inv: torch.Tensor, repeats: int) -> dict:
    from pckernels import ops

    block = torch.randn(layout.num_layers, 2, layout.num_kv_heads, n, layout.head_dim, dtype=dtype)
    out = torch.empty(layout.num_layers, 2, layout.num_kv_heads, n + 7, layout.head_dim, dtype=dtype)
    cases = {"gather_concat": lambda: ops.gather_concat(out, [block], torch.tensor([[0, 0, 3, n]])),
             "gather_rotate": lambda: ops.gather_rotate(out, [block], torch.tensor([[0, 0, 3, n, -1234]]), inv)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": n, **{f"{k}_ms": 1e3 * v for k, v in med.items()},
            "rotate_us_per_token": 1e6 * (med["gather_rotate"] - med["gather_concat"]) / n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_compact", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 7680],
                    help="cached tokens imported per query (8K: 7680, so the schema fits SmolLM2's 8192 positions)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--filler", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from pckernels import PromptCache

    torch.set_num_threads(args.threads)
    cache = PromptCache.from_pretrained(store_dir=False, device_budget="8GiB")
    rows = []
    for total in args.tokens:
        schema, (at_schema, compact) = workload(cache.tokenizer, total, args.k, args.filler)
        cache.add_schema(schema)
        for prompt in (at_schema, compact):
            cache.generate(prompt, max_new_tokens=1)
        plan = cache.request(compact).plan
        moved = sum(ref.n_rows for ref in plan.blocks if ref.shifts)

        def copied(prompt: str) -> float:
            cache.evict_resident()
            return cache.generate(prompt, max_new_tokens=1).ttft_s

        def resident(prompt: str) -> float:
            copied(prompt)
            return cache.generate(prompt, max_new_tokens=1).ttft_s

        cases = {"schema": partial(copied, at_schema), "compact": partial(copied, compact),
                 "schema_resident": partial(resident, at_schema), "compact_resident": partial(resident, compact)}
        samples: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                samples[name].append(fn())
        med = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
        result = cache.generate(compact, max_new_tokens=1)
        row = {"cached_tokens": result.cached_tokens, "computed_tokens": result.computed_tokens, "moved_rows": moved,
               **{f"{k}_ms": v for k, v in med.items()},
               "compact_over_schema": med["compact"] / med["schema"],
               "compact_over_schema_resident": med["compact_resident"] / med["schema_resident"],
               "samples_ms": {k: [1e3 * x for x in v] for k, v in samples.items()},
               "breakdown_compact": profile(cache, partial(copied, compact)),
               "breakdown_schema": profile(cache, partial(copied, at_schema)),
               # on the scheduler thread, like the engine's own copies (pckernels.engine.threads)
               "copy": cache.scheduler.call(partial(copy_seconds, cache.layout, total // args.k, cache.dtype,
                                                    cache.key_rotation().inv_freq, 15))}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("breakdown")}, indent=1), flush=True)
    report = {"settings": {"model": cache.name, "threads": args.threads, "rounds": args.rounds,
                           "filler": args.filler, "k": args.k, "torch": torch.__version__,
                           "machine": platform.machine()}, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
