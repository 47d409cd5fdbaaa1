"""Experiment 7 — many streams at once: the RAG k-of-N workload served to 1, 2, 4, 8, 16
concurrent clients by one engine, against the same requests served one at a time.

Each of ``S`` client threads sends ``concurrency_requests`` RAG queries back to back (greedy,
``concurrency_tokens`` new tokens each; every request arrives when its client is ready). The same
engine serves them two ways, interleaved round by round:

* ``batched``: the scheduler as shipped — requests share forwards (continuous batching) and each
  module is placed once in the KV arena for every request that imports it;
* ``one_at_a_time``: ``max_batch = 1``, so requests queue and run alone (what a lock around a
  single-request engine gives).

Reported per ``S``: aggregate generated tokens per second (all tokens over the wall time of the
round), TTFT p50 / p99 from each request's arrival, and, for ``batched``, the KV arena's rows in use
at its busiest moment against the rows of the distinct modules the running requests import
(shared, not duplicated), and what a private copy of its modules per request would take. Every batched answer is checked
against the same request run alone (greedy tokens, and the largest first-logit difference).
"""

from __future__ import annotations

import statistics
import threading
import time

from perf.suite.context import Bench
from perf.suite.stats import summarize
from perf.suite.workloads import rag


def steps(bench: Bench) -> int:
    return len(bench.config.concurrency_streams) * bench.config.repeats * 2


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


def serve(engine, prompts: list[list[str]], max_new_tokens: int) -> dict:
    """Client ``i`` sends ``prompts[i]`` in order; returns wall seconds, tokens, TTFTs, results."""
    results: dict[tuple[int, int], object] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts) + 1)

    def client(i: int) -> None:
        try:
            barrier.wait()
            for j, prompt in enumerate(prompts[i]):
                results[i, j] = engine.generate(prompt, max_new_tokens=max_new_tokens)
        except BaseException as exc:  # re-raised in the measuring thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    tokens = sum(len(r.token_ids) for r in results.values())
    return {"wall_s": wall, "tokens": tokens, "ttft": [r.ttft_s for r in results.values()], "results": results}


def run(bench: Bench) -> dict:
    engine, cfg = bench.engine, bench.config
    workload = rag(bench)
    bench.add_schema(workload.schema)
    pool = [q.pml for q in workload.queries]
    n = cfg.concurrency_tokens
    alone = {}
    for prompt in pool:
        engine.evict_resident()
        alone[prompt] = engine.generate(prompt, max_new_tokens=n)
    scheduler = engine.scheduler
    rows = []
    for streams in cfg.concurrency_streams:
        prompts = [[pool[(i * cfg.concurrency_requests + j) % len(pool)] for j in range(cfg.concurrency_requests)]
                   for i in range(streams)]
        samples = {"batched": [], "one_at_a_time": []}
        peak, mismatches, worst = {"rows": 0, "module_rows": 0, "private_module_rows": 0}, 0, 0.0
        for round_index in range(cfg.repeats):
            order = ("batched", "one_at_a_time") if round_index % 2 == 0 else ("one_at_a_time", "batched")
            for method in order:
                engine.evict_resident()
                saved = scheduler.max_batch
                scheduler.max_batch = 1 if method == "one_at_a_time" else saved
                scheduler.reset_peak()
                try:
                    served = serve(engine, prompts, n)
                finally:
                    scheduler.max_batch = saved
                if method == "batched" and scheduler.peak["rows"] > peak["rows"]:
                    peak = dict(scheduler.peak)
                if method == "batched":
                    for (i, j), got in served["results"].items():
                        want = alone[prompts[i][j]]
                        mismatches += got.token_ids != want.token_ids
                        worst = max(worst, float((got.first_logits - want.first_logits).abs().max()))
                served.pop("results")
                samples[method].append(served)
                bench.ticker.advance()
        row = {"streams": streams, "requests": streams * cfg.concurrency_requests, "max_new_tokens": n,
               "answers_equal_alone": mismatches == 0, "mismatched_answers": mismatches,
               "first_logits_max_abs_diff": worst}
        for method, runs in samples.items():
            ttfts = [t for run_ in runs for t in run_["ttft"]]
            row[method] = {"tokens_per_s": summarize([r["tokens"] / r["wall_s"] for r in runs]),
                           "wall_s": summarize([r["wall_s"] for r in runs]),
                           "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}
        row["throughput_ratio"] = (row["batched"]["tokens_per_s"]["median"]
                                   / row["one_at_a_time"]["tokens_per_s"]["median"])
        bytes_per_row = scheduler.arena.bytes_per_row
        row["kv"] = {**peak, "bytes": peak["rows"] * bytes_per_row,
                     "over_distinct_modules": peak["rows"] / peak["module_rows"] if peak["module_rows"] else None,
                     "private_over_distinct": (peak["private_module_rows"] / peak["module_rows"]
                                               if peak["module_rows"] else None)}
        rows.append(row)
    eight = next((r for r in rows if r["streams"] == 8), None)
    one = next((r for r in rows if r["streams"] == 1), None)
    for row in rows:
        row["batched_over_one_stream"] = (row["batched"]["tokens_per_s"]["median"]
                                          / one["batched"]["tokens_per_s"]["median"]) if one else None
    return {"workload": workload.description, "rows": rows,
            "throughput_at_8": eight["throughput_ratio"] if eight else None,
            "kv_at_8_over_distinct_modules": eight["kv"]["over_distinct_modules"] if eight else None,
            "answers_equal_alone": all(r["answers_equal_alone"] for r in rows)}
