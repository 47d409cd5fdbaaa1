"""What the default mode costs: compact placement with epic@8 recompute vs schema placement.

``python -m perf.bench_defaults`` (embedded model): the perf suite's document-QA, RAG and
template workloads (``perf.suite.workloads``) with schemas of about ``--sizes`` tokens (RAG: 4 of
8 passages, so its prompts are half that), each query answered by

* ``baseline``: no reuse (the whole prompt computed, contiguous positions);
* ``schema``: an engine built with ``placement="schema"`` (the paper's semantics, nothing recomputed);
* ``default``: an engine with the defaults (compact placement, the first 8 stale tokens of each
  module recomputed);

timed interleaved over ``--rounds`` with the blocks resident in the arena (each engine answered the
query before) and, for ``schema`` and ``default``, once more with the blocks copied from the store
(``evict_resident`` first). Also per query: computed tokens, and whether ``--check-tokens`` greedy
tokens equal the baseline's. Writes ``defaults.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from perf.suite.config import SuiteConfig
from perf.suite.context import Bench
from perf.suite.stats import interleaved, paired_ratio, summarize
from perf.suite.workloads import doc_qa, rag, template

BUILDERS = {"doc_qa": doc_qa, "rag": rag, "template": template}
ENGINES = ("schema", "default")


def config_for(size: int, queries: int) -> SuiteConfig:
    """The suite's workloads with schemas of about ``size`` tokens."""
    return SuiteConfig(name=f"defaults-{size}", doc_qa_tokens=size, rag_docs=8, rag_doc_tokens=size // 8, rag_k=4,
                       template_system_tokens=size, queries=queries)


def ttft(engine, prompt: str, *, evict: bool = False, mode: str = "cached") -> float:
    if evict:
        engine.evict_resident()
    return engine.generate(prompt, max_new_tokens=1, mode=mode).ttft_s


def measure(engines: dict, workload, rounds: int, check_tokens: int) -> dict:
    """Every query of ``workload``: per-series TTFT samples, computed tokens, answers vs baseline."""
    for engine in engines.values():
        engine.add_schema(workload.schema)
    queries = []
    for query in workload.queries:
        base = engines["schema"].generate(query.pml, mode="baseline", max_new_tokens=check_tokens)
        row: dict = {"prompt_tokens": len(base.prompt_token_ids)}
        for name, engine in engines.items():
            got = engine.generate(query.pml, max_new_tokens=check_tokens)
            row[f"{name}_computed"] = got.computed_tokens
            row[f"{name}_same_as_baseline"] = got.token_ids == base.token_ids
            row[f"{name}_common_prefix"] = next((i for i, (a, b) in enumerate(zip(got.token_ids, base.token_ids))
                                                 if a != b), min(len(got.token_ids), len(base.token_ids)))
        cases = {"baseline": lambda q=query.pml: ttft(engines["schema"], q, mode="baseline")}
        for name, engine in engines.items():
            cases[name] = lambda e=engine, q=query.pml: ttft(e, q)
            cases[f"{name}_copied"] = lambda e=engine, q=query.pml: ttft(e, q, evict=True)
        samples = interleaved(cases, rounds)
        row.update({name: summarize(values) for name, values in samples.items()})
        row["default_over_schema"] = paired_ratio(samples["default"], samples["schema"])
        row["default_over_schema_copied"] = paired_ratio(samples["default_copied"], samples["schema_copied"])
        queries.append(row)
    return {"name": workload.name, "description": workload.description, "queries": queries}


def table(results: dict) -> str:
    lines = ["| workload | schema tokens | prompt tokens | computed: schema / default | TTFT ms: no reuse / schema / "
             "default (resident) | default ÷ schema resident / copied | answers = no reuse: schema / default |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for size, workloads in results["sizes"].items():
        for wl in workloads:
            qs = wl["queries"][1:] or wl["queries"]

            def med(key: str) -> float:
                return statistics.median(q[key]["median"] for q in qs) * 1e3

            def mid(key: str) -> float:
                return statistics.median(q[key] for q in qs)

            same = {name: sum(q[f"{name}_same_as_baseline"] for q in wl["queries"]) for name in ENGINES}
            lines.append(f"| {wl['name']} | {size} | {mid('prompt_tokens'):.0f} | {mid('schema_computed'):.0f} / "
                         f"{mid('default_computed'):.0f} | {med('baseline'):.0f} / {med('schema'):.0f} / "
                         f"{med('default'):.0f} | {mid('default_over_schema'):.2f} / "
                         f"{mid('default_over_schema_copied'):.2f} | {same['schema']} / {same['default']} of "
                         f"{len(wl['queries'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--workloads", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    parser.add_argument("--out", type=Path, default=Path("perf/results/cpu-2c/defaults"))
    args = parser.parse_args(argv)
    from pckernels.engine import PromptCache

    engines = {name: PromptCache.from_pretrained(args.model, store_dir=False,
                                                 placement="schema" if name == "schema" else "compact")
               for name in ENGINES}
    results: dict = {"model": args.model, "machine": platform.machine(), "threads": torch.get_num_threads(),
                     "rounds": args.rounds, "check_tokens": args.check_tokens, "sizes": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for size in args.sizes:
        bench = Bench(engines["schema"], config_for(size, args.queries))
        results["sizes"][size] = []
        for name in args.workloads:
            workload = BUILDERS[name](bench)
            results["sizes"][size].append(measure(engines, workload, args.rounds, args.check_tokens))
            (args.out / "defaults.json").write_text(json.dumps(results, indent=1))
    results["seconds"] = time.perf_counter() - started
    (args.out / "defaults.json").write_text(json.dumps(results, indent=1))
    summary = (f"# Default mode (compact + epic@8) vs schema placement\n\n`python -m perf.bench_defaults "
               f"--sizes {' '.join(map(str, args.sizes))} --queries {args.queries} --rounds {args.rounds}`, "
               f"{args.model}, {results['threads']} threads. Medians over the queries after the first (TTFT "
               f"medians of {args.rounds} interleaved rounds each); answers compared over {args.check_tokens} "
               f"greedy tokens.\n\n{table(results)}\n")
    (args.out / "summary.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
