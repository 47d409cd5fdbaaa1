"""The remote (Redis) tier measured: a cold process's first query, and a fleet of servers.

``python -m perf.remote_fleet [--repeats 3] [--rag 8 256 4] [--servers 4] [--clients 8] [--out DIR]``

Needs ``redis-server`` (started here on a free loopback port, nothing persisted).

1. **Cold process, first RAG query** (embedded model, library): each trial is a fresh Python
   process that loads the model (not timed), then times ``add_schema`` of the RAG schema plus the
   first ``generate`` of a query importing ``K`` of its passages. Three ways, interleaved per
   repeat (one short forward warms the kernels up first, untimed): ``encode`` (empty local tiers, no remote: every module is encoded), ``remote`` (empty
   local tiers, the blocks in Redis, uploaded beforehand by another process) and ``disk`` (no
   remote, this machine's disk tier warm — the single-machine restart case, for reference).
   Reported: medians of install, first-query TTFT and their sum; blocks encoded; bytes read from
   Redis and per cached token; whether every way gives the same tokens and first logits.
2. **Fleet** (``--servers`` ``promptcache serve`` processes, one thread each, ``--memory-only``):
   once with a shared ``--remote`` Redis, once with private stores. The RAG schema is uploaded to
   every server at once; then ``--clients`` concurrent clients replay the RAG workload (PML),
   requests spread round-robin over the servers as a load balancer would. Then one template
   request (a new 512-token system prompt, plain messages, exact prefix reuse) goes to the first
   server, and after 2 s the clients replay the template workload round-robin: the other servers
   meet that system prompt for the first time. Reported: time until every server is ready, blocks
   encoded across the fleet, TTFT p50/p99 per workload, cached tokens.

Writes ``remote_fleet.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from perf.server_load import cell, rag_workload, start_server, template_workload, upload

MODES = ("encode", "remote", "disk")


def worker(args) -> int:
    """One cold process: load, then time ``add_schema`` + the first query; print a JSON line."""
    import hashlib

    import torch

    from pckernels.engine import PromptCache

    torch.set_num_threads(args.threads)
    schema = Path(args.schema).read_text(encoding="utf-8")
    prompt = Path(args.prompt).read_text(encoding="utf-8")
    t_load = time.perf_counter()
    pc = PromptCache.from_pretrained("smollm2", device="cpu", dtype="float32",
                                     store_dir=args.store_dir or False, remote=args.remote)
    pc.complete("Warm up the kernels.", max_new_tokens=2, reuse=False)
    load_s = time.perf_counter() - t_load
    t0 = time.perf_counter()
    pc.add_schema(schema)
    install_s = time.perf_counter() - t0
    result = pc.generate(prompt, max_new_tokens=args.tokens)
    first_query_s = time.perf_counter() - t0
    if args.flush:
        pc.store.flush()
    stats = pc.stats()
    remote = stats.get("remote") or {}
    print(json.dumps({
        "load_s": load_s, "install_s": install_s, "ttft_s": result.ttft_s, "first_query_s": first_query_s,
        "encodes": stats["encodes"], "encode_s": stats["encode_s"], "cached_tokens": result.cached_tokens,
        "computed_tokens": result.computed_tokens, "remote_bytes_read": remote.get("bytes_read", 0),
        "remote_hits": remote.get("hits", 0), "remote_read_s": remote.get("read_s", 0.0),
        "remote_bytes_written": remote.get("bytes_written", 0),
        "disk_loads": (stats.get("disk") or {}).get("loads", 0),
        "tokens": result.token_ids,
        "logits_sha": hashlib.sha256(result.first_logits.float().numpy().tobytes()).hexdigest()}))
    pc.close()
    return 0


def run_worker(mode: str, files: dict, redis_url: str, disk: str, threads: int, tokens: int,
               flush: bool = False) -> dict:
    cmd = [sys.executable, "-m", "perf.remote_fleet", "worker", "--schema", files["schema"], "--prompt",
           files["prompt"], "--threads", str(threads), "--tokens", str(tokens)]
    if mode in ("remote", "seed"):
        cmd += ["--remote", redis_url]
    if mode in ("disk", "seed"):
        cmd += ["--store-dir", disk]
    if flush:
        cmd.append("--flush")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold_first_query(args, redis_url: str, workload) -> dict:
    query = workload.next()
    tmp = Path(tempfile.mkdtemp(prefix="promptcache-remote-perf-"))
    files = {"schema": str(tmp / "schema.xml"), "prompt": str(tmp / "prompt.xml")}
    Path(files["schema"]).write_text(workload.schema, encoding="utf-8")
    Path(files["prompt"]).write_text(query.pml, encoding="utf-8")
    disk = str(tmp / "kv")
    seed = run_worker("seed", files, redis_url, disk, args.threads, args.tokens, flush=True)
    print(f"seeded Redis and disk: {seed['encodes']} blocks encoded, "
          f"{seed['remote_bytes_written'] / 2**20:.1f} MiB uploaded", flush=True)
    trials: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        order = MODES[repeat % 3:] + MODES[:repeat % 3]
        for mode in order:
            trial = run_worker(mode, files, redis_url, disk, args.threads, args.tokens)
            trials[mode].append(trial)
            print(f"  repeat {repeat} {mode:6s}: install {trial['install_s'] * 1e3:7.0f} ms, first query "
                  f"{trial['first_query_s'] * 1e3:7.0f} ms, {trial['encodes']} encoded", flush=True)
    out = {"seed": seed, "trials": trials, "modes": {}}
    reference = (seed["tokens"], seed["logits_sha"])
    for mode, runs in trials.items():
        med = {k: statistics.median(r[k] for r in runs) for k in
               ("install_s", "ttft_s", "first_query_s", "encodes", "remote_bytes_read", "remote_read_s")}
        cached = statistics.median(r["cached_tokens"] for r in runs)
        med["bytes_per_cached_token"] = med["remote_bytes_read"] / cached if med["remote_bytes_read"] else 0.0
        med["cached_tokens"] = cached
        med["same_output"] = all((r["tokens"], r["logits_sha"]) == reference for r in runs)
        out["modes"][mode] = med
    out["speedup_remote_vs_encode"] = out["modes"]["encode"]["first_query_s"] / out["modes"]["remote"]["first_query_s"]
    return out


def _metric(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


async def _spread(urls: list[str], model: str, method: str, workload, clients: int, requests: int, tokens: int,
                  limit_s: float) -> dict:
    """``clients`` closed-loop clients, client ``i`` talking to server ``i mod len(urls)``."""
    groups = [clients // len(urls) + (1 if i < clients % len(urls) else 0) for i in range(len(urls))]
    rows = await asyncio.gather(*(cell(url, model, method, workload, n, requests, tokens, limit_s)
                                  for url, n in zip(urls, groups) if n))
    from perf.suite.concurrency import percentile

    ttft = [t for r in rows for t in r.pop("ttft_samples_s")]
    return {"requests": sum(r["requests"] for r in rows), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "mean_cached_tokens": statistics.fmean(r["mean_cached_tokens"] for r in rows),
            "mean_prompt_tokens": statistics.fmean(r["mean_prompt_tokens"] for r in rows)}


def fleet(args, shared: bool, tokenizer) -> dict:
    from pckernels.store.testing import LocalRedis

    redis_server = LocalRedis().start() if shared else None
    extra = ["--remote", redis_server.url] if shared else []
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs: list[subprocess.Popen] = []
    try:
        started = [None] * args.servers

        def launch(i: int) -> None:
            started[i] = start_server("smollm2", extra)

        threads = [threading.Thread(target=launch, args=(i,)) for i in range(args.servers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        procs = [p for p, _ in started]
        urls = [u for _, u in started]
        rag = rag_workload(tokenizer, *args.rag, seed=11)
        template = template_workload(tokenizer, args.template_tokens)
        t0 = time.perf_counter()
        uploads = [threading.Thread(target=upload, args=(u, rag.schema)) for u in urls]
        for t in uploads:
            t.start()
        for t in uploads:
            t.join()
        ready_s = time.perf_counter() - t0
        encodes_at_ready = sum(_metric(httpx.get(u + "/metrics").text, "promptcache_store_encodes_total")
                               for u in urls)
        row = {"shared": shared, "servers": args.servers, "ready_s": ready_s, "encodes_at_ready": encodes_at_ready}
        row["rag"] = asyncio.run(_spread(urls, "smollm2", "prompt_cache", rag, args.clients, args.requests,
                                         args.tokens, args.cell_limit))
        asyncio.run(cell(urls[0], "smollm2", "prefix", template, 1, 1, args.tokens, args.cell_limit))
        time.sleep(2.0)
        row["template_prefix"] = asyncio.run(_spread(urls, "smollm2", "prefix", template, args.clients,
                                                     args.requests, args.tokens, args.cell_limit))
        texts = [httpx.get(u + "/metrics").text for u in urls]
        row["encodes"] = sum(_metric(t, "promptcache_store_encodes_total") for t in texts)
        row["remote_bytes_read"] = sum(_metric(t, "promptcache_remote_bytes_total") for t in texts) if shared else 0
        return row
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
        if redis_server is not None:
            redis_server.stop()


def summary(result: dict, args) -> str:
    cold = result["cold"]
    docs, doc_tokens, k = args.rag
    lines = ["# The remote (Redis) tier", "",
             f"`python -m perf.remote_fleet {' '.join(sys.argv[1:])}` — embedded SmolLM2-135M, fp32, CPU "
             f"({os.cpu_count()} CPUs visible), redis-server {result.get('redis_version', '?')} on loopback.", "",
             f"## A cold process's first RAG query ({k} of {docs} passages of {doc_tokens} tokens)", "",
             f"Fresh process per trial, {args.threads} threads, model load not timed; medians of {args.repeats}, "
             "the three ways interleaved. *Install*: `add_schema` (encode every module, or find them); *first "
             "query*: install plus the first `generate` (TTFT of one token included).", "",
             "| way | install | first-query TTFT | install + first query | blocks encoded | MiB from Redis | "
             "bytes / cached token | same output |", "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        m = cold["modes"][mode]
        lines.append(f"| {mode} | {m['install_s'] * 1e3:.0f} ms | {m['ttft_s'] * 1e3:.0f} ms | "
                     f"{m['first_query_s'] * 1e3:.0f} ms | {m['encodes']:.0f} | {m['remote_bytes_read'] / 2**20:.1f} | "
                     f"{m['bytes_per_cached_token']:.0f} | {'yes' if m['same_output'] else 'NO'} |")
    lines += ["", f"**From Redis vs encoding: {cold['speedup_remote_vs_encode']:.1f}x faster** to the first "
              "token of the first query (target ≥ 10x).", ""]
    if result.get("fleet"):
        lines += [f"## A fleet of {args.servers} servers (one thread each, {args.clients} clients round-robin, "
                  f"{args.requests} requests each, {args.tokens} tokens)", "",
                  "| stores | all ready after upload | blocks encoded at ready | blocks encoded in all | "
                  "RAG (PML) TTFT p50 / p99 | template, plain prefix TTFT p50 / p99 | template cached tokens |",
                  "|---|---|---|---|---|---|---|"]
        for row in result["fleet"]:
            lines.append(f"| {'shared Redis' if row['shared'] else 'private'} | {row['ready_s']:.1f} s | "
                         f"{row['encodes_at_ready']:.0f} | {row['encodes']:.0f} | "
                         f"{row['rag']['ttft_p50_s'] * 1e3:.0f} / {row['rag']['ttft_p99_s'] * 1e3:.0f} ms | "
                         f"{row['template_prefix']['ttft_p50_s'] * 1e3:.0f} / "
                         f"{row['template_prefix']['ttft_p99_s'] * 1e3:.0f} ms | "
                         f"{row['template_prefix']['mean_cached_tokens']:.0f} of "
                         f"{row['template_prefix']['mean_prompt_tokens']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.remote_fleet", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="(internal) one cold process")
    w.add_argument("--schema", required=True)
    w.add_argument("--prompt", required=True)
    w.add_argument("--remote")
    w.add_argument("--store-dir")
    w.add_argument("--threads", type=int, default=2)
    w.add_argument("--tokens", type=int, default=1)
    w.add_argument("--flush", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1, help="new tokens of the cold query; of each fleet request")
    ap.add_argument("--rag", type=int, nargs=3, default=[8, 256, 4], metavar=("DOCS", "DOC_TOKENS", "K"))
    ap.add_argument("--template-tokens", type=int, default=512)
    ap.add_argument("--servers", type=int, default=4, help="fleet size (0: skip the fleet part)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--cell-limit", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=Path("perf/results/cpu-2c/remote"))
    args = ap.parse_args(argv)
    if args.command == "worker":
        return worker(args)

    from pckernels.integration.embedded import load_tokenizer
    from pckernels.store.testing import LocalRedis

    tokenizer = load_tokenizer()
    result: dict = {"argv": sys.argv[1:]}
    with LocalRedis() as redis_server:
        result["redis_version"] = redis_server.client().info("server").get("redis_version")
        result["cold"] = cold_first_query(args, redis_server.url, rag_workload(tokenizer, *args.rag))
    _write(args.out, result, args)
    if args.servers:
        result["fleet"] = []
        for shared in (True, False):
            row = fleet(args, shared, tokenizer)
            result["fleet"].append(row)
            print(f"fleet shared={shared}: ready {row['ready_s']:.1f} s, {row['encodes']:.0f} blocks encoded, RAG TTFT "
                  f"p50 {row['rag']['ttft_p50_s'] * 1e3:.0f} ms p99 {row['rag']['ttft_p99_s'] * 1e3:.0f} ms",
                  flush=True)
            _write(args.out, result, args)
    print(f"wrote {args.out}/summary.md")
    return 0


def _write(out: Path, result: dict, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "remote_fleet.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text(summary(result, args))


if __name__ == "__main__":
    raise SystemExit(main())
