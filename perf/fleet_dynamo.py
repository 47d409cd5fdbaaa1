"""promptcache engines as NVIDIA Dynamo workers behind Dynamo's KV router: ``kv`` vs ``round-robin``.

``python -m perf.fleet_dynamo --dynamo-python PY [--workers 3] [--chats 96] [...] [--out DIR]``

vllm-router 0.1.17 (``perf.fleet``) weighs a worker's load by the requests it has in flight, so two
cold first turns can land on one replica while another decodes a hit. Dynamo's KV router keeps its
own count of each worker's active prefill tokens and blocks, and scores a worker by the blocks it
would have to compute plus that load. This measures what that does with promptcache's engines.

``PY`` is a Python that imports ``dynamo`` (``ai-dynamo`` and ``ai-dynamo-runtime`` 1.6.1) *and*
``pckernels`` (``docs/fleet.md``, "Dynamo's KV router", gives the recipe). Each worker
(``--worker``, run by ``PY`` with this checkout on ``PYTHONPATH``) is ``promptcache
dynamo-worker``'s handler and registration (``pckernels.cli_dynamo.run_worker``) over one engine
(the embedded SmolLM2, one thread, ``prefix_block_size`` 16, token resumption, 96 MiB of prefix
blocks, no disk tier; the shared Redis under a namespace of its run, or none with ``--no-remote``),
warmed by two prompts before it registers, writing a line per answer (its cached tokens and the
worker's Redis reads). Per mode a fresh set of workers and one ``python -m dynamo.frontend
--router-mode MODE`` (``--router-arg`` adds options) on loopback, file discovery, TCP requests, ZMQ
events; the same workload as ``perf.fleet`` (its ``workload`` and client), first answered by one
``promptcache serve`` (``--reference``, the answers every mode must give). ``--kill`` runs ``kv``
once more and SIGKILLs the last worker mid-run.

Writes ``fleet-dynamo.json`` and ``README.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from perf.fleet import BLOCK, Options, Record, _ms, compare, recovery, run, summary, warmup_text, workload

log = logging.getLogger("perf.fleet_dynamo")
MODES = ("kv", "round-robin")
LOOPBACK = {"DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_SELF_HOST_METADATA": "0"}
"""Dynamo's sockets on loopback only."""


# -- the worker (run by the Dynamo Python) --------------------------------------------------------

def serve_worker(args) -> None:
    """One engine as a Dynamo worker — ``promptcache dynamo-worker``'s own handler and registration
    (``pckernels.cli_dynamo.run_worker``), warmed first, with a JSON line per answer to ``args.log_file``."""
    from pckernels.cli_common import engine_settings, load_engine
    from pckernels.cli_dynamo import run_worker
    from pckernels.cli_engine import start_kv_events
    from pckernels.server.dynamo_worker import DynamoSettings

    events_at = f"ipc://{args.run_dir}/{args.name}.events"
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_at,
                         "replay_endpoint": f"ipc://{args.run_dir}/{args.name}.replay"})
    config = engine_settings("smollm2", store_dir=False, device_budget="0",  # as perf.fleet's memory-only replicas
                             host_budget="0", prefix_budget=args.budget, remote=args.redis or None,
                             remote_namespace=args.namespace, prefix_block_size=BLOCK, prefix_resume="token",
                             kv_events=events)
    config = config.replace(kv_events=start_kv_events(config.kv_events))
    engine = load_engine("smollm2", config)
    for i in range(2):  # its first forwards paid before it serves (as perf.fleet warms its replicas)
        engine.complete(warmup_text(i), max_new_tokens=4, reuse=False)
    lines = open(args.log_file, "a", buffering=1)

    def observe(result, handle) -> None:
        remote = (engine.stats().get("remote") or {}).get("hits", 0)
        lines.write(json.dumps({"worker": args.name, "prompt": len(result.prompt_token_ids),
                                "cached": result.cached_tokens, "remote_hits": remote, "t": time.time()}) + "\n")

    log.info("worker %s serving", args.name)
    run_worker(engine, DynamoSettings(endpoint="dyn://promptcache.backend.generate", model_name="smollm2",
                                      discovery_backend="file", request_plane="tcp", event_plane="zmq"),
               model="smollm2", events_endpoint=events_at, work_dir=Path(args.run_dir), max_tokens=64,
               observe=observe)


# -- the driver -----------------------------------------------------------------------------------

class DynamoFleet:
    """``n`` workers and a frontend in ``mode``, file discovery under ``run_dir``; ``stop`` ends them."""

    def __init__(self, python: str, n: int, mode: str, run_dir: Path, redis_url: str | None, namespace: str,
                 budget: str, port: int, router_args: tuple[str, ...] = ()) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        repo = Path(__file__).resolve().parents[1]
        env = {**os.environ, **LOOPBACK, "DYN_FILE_KV": str(run_dir / "discovery"), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(repo)}
        self.log_file = run_dir / "requests.jsonl"
        self.procs: list[subprocess.Popen] = []
        for i in range(n):
            cmd = [python, "-m", "perf.fleet_dynamo", "--worker", "--name", f"w{i}", "--run-dir", str(run_dir),
                   "--redis", redis_url or "", "--namespace", namespace, "--budget", budget,
                   "--log-file", str(self.log_file)]
            self.procs.append(subprocess.Popen(cmd, env=env, cwd=repo, stdout=open(run_dir / f"w{i}.log", "w"),
                                               stderr=subprocess.STDOUT))
        self.url = f"http://127.0.0.1:{port}"
        cmd = [python, "-m", "dynamo.frontend", "--router-mode", mode, "--http-host", "127.0.0.1",
               "--http-port", str(port), "--discovery-backend", "file", "--request-plane", "tcp",
               "--event-plane", "zmq", *router_args]
        self.procs.append(subprocess.Popen(cmd, env=env, cwd=repo, stdout=open(run_dir / "frontend.log", "w"),
                                           stderr=subprocess.STDOUT))
        self._ready(n)

    def _ready(self, n: int, timeout: float = 300.0) -> None:
        """Until ``n`` workers answered a request through the frontend (each registered and serving)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a Dynamo process ended at start; see {self.run_dir}")
            ready = sum(1 for line in _lines(self.run_dir) if "serving" in line)
            if ready >= n:
                try:
                    models = httpx.get(f"{self.url}/v1/models", timeout=5).json().get("data") or []
                except httpx.HTTPError:
                    models = []
                if models:
                    time.sleep(2.0)  # every worker's instance reaches the router
                    return
            time.sleep(1.0)
        raise RuntimeError(f"the Dynamo fleet was not ready in {timeout:.0f} s; see {self.run_dir}")

    def kill(self, i: int) -> None:
        """SIGKILL worker ``i`` (no goodbye to the frontend: as a crashed machine)."""
        self.procs[i].kill()

    def requests(self) -> list[dict]:
        if not self.log_file.exists():
            return []
        return [json.loads(line) for line in self.log_file.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _lines(run_dir: Path):
    for path in run_dir.glob("w*.log"):
        yield from path.read_text(errors="replace").splitlines()


def worker_hits(requests: list[dict]) -> dict:
    """Hit rates from the workers' own lines: cached prompt tokens / prompt tokens, and the same less
    the blocks read from Redis (each worker's ``remote_hits`` counter, its last value less its first)."""
    prompt = sum(r["prompt"] for r in requests)
    cached = sum(r["cached"] for r in requests)
    remote = 0
    for name in {r["worker"] for r in requests}:
        mine = sorted((r for r in requests if r["worker"] == name), key=lambda r: r["t"])
        remote += mine[-1]["remote_hits"]
    local = max(0, cached - BLOCK * remote)
    return {"worker_prompt_tokens": prompt, "worker_cached_tokens": cached, "remote_blocks": remote,
            "hit_rate": cached / prompt if prompt else 0.0, "local_hit_rate": local / prompt if prompt else 0.0,
            "per_worker": {name: sum(1 for r in requests if r["worker"] == name)
                           for name in sorted({r["worker"] for r in requests})}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.fleet_dynamo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dynamo-python", help="a Python that imports dynamo and pckernels")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--budget", default="96MiB", help="each worker's prefix budget")
    for name, default in (("tenants", 6), ("docs-per-tenant", 3), ("doc-tokens", 192), ("chats", 96), ("turns", 3),
                          ("concurrency", 4), ("tokens", 8)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--limit", type=float, default=900.0)
    ap.add_argument("--remote", action=argparse.BooleanOptionalAction, default=True,
                    help="the workers share a Redis (default); --no-remote: each keeps its own blocks only")
    ap.add_argument("--kill", action=argparse.BooleanOptionalAction, default=False,
                    help="then run the workload once more in kv mode and SIGKILL the last worker once --kill-after "
                         "of the requests were answered (a failed request is retried once)")
    ap.add_argument("--kill-after", type=float, default=0.4)
    ap.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                    help="passed to dynamo.frontend as is (repeat; e.g. --router-arg=--router-temperature=0.5)")
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                    help="first answer the workload with one `promptcache serve` (no router, no Dynamo) and "
                         "compare every mode's answers with it (default on)")
    ap.add_argument("--out", type=Path, default=Path("perf/results/cpu-2c/fleet-dynamo"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("name", "run-dir", "redis", "namespace", "log-file"):
        ap.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.worker:
        serve_worker(args)
        return 0
    if not args.dynamo_python:
        ap.error("--dynamo-python is needed (a Python that imports dynamo and pckernels; docs/fleet.md)")
    from pckernels.integration.embedded import load_tokenizer
    from pckernels.store.testing import LocalRedis, free_port

    opts = Options(tenants=args.tenants, docs_per_tenant=args.docs_per_tenant, doc_tokens=args.doc_tokens,
                   chats=args.chats, turns=args.turns, tokens=args.tokens, concurrency=args.concurrency)
    convs = workload(load_tokenizer(), opts)
    args.out.mkdir(parents=True, exist_ok=True)
    redis = LocalRedis().start() if args.remote else None
    result: dict = {"argv": sys.argv[1:], "options": asdict(opts), "workers": args.workers, "budget": args.budget,
                    "remote": args.remote, "router_args": args.router_arg, "modes": {}}
    answers: dict[str, dict] = {}
    try:
        if args.reference:  # one promptcache serve replica, no router: the answers every mode must give
            from perf.server_load import start_server

            proc, url = start_server("smollm2", ["--prefix-block", str(BLOCK), "--prefix-resume", "token"])
            try:
                records, _ = asyncio.run(run(url, "smollm2", convs, opts, args.limit))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            answers["reference"] = {(r.conv, r.turn): r.answer for r in records if r.ok}
        for mode in args.modes:
            run_dir = Path(tempfile.mkdtemp(prefix=f"pc-dynamo-{mode}-"))
            fleet = DynamoFleet(args.dynamo_python, args.workers, mode, run_dir, redis.url if redis else None,
                                f"perf-dynamo-{mode}", args.budget, free_port(), tuple(args.router_arg))
            try:
                records, wall = asyncio.run(run(fleet.url, "smollm2", convs, opts, args.limit))
                row = summary(records, wall)
                row.update(worker_hits(fleet.requests()))
                row["records"] = [asdict(r) for r in records]
            finally:
                fleet.stop()
                shutil.copy(run_dir / "frontend.log", args.out / f"frontend-{mode}.log")
            answers[mode] = {(r.conv, r.turn): r.answer for r in records if r.ok}
            result["modes"][mode] = row
            log.info("%s: hit %.1f%% local %.1f%% TTFT p50 %.0f ms p95 %.0f ms p99 %.0f ms after opening %.0f ms, "
                     "%.2f req/s, failed %d", mode, 100 * row["hit_rate"], 100 * row["local_hit_rate"],
                     1e3 * row["ttft_p50_s"], 1e3 * row["ttft_p95_s"], 1e3 * row["ttft_p99_s"],
                     1e3 * (row["ttft_p99_after_opening_s"] or 0), row["requests_per_s"], row["failed"])
        if args.kill and args.workers >= 2:
            result["kill"] = kill_run(args, convs, opts, redis, answers)
        first = "reference" if args.reference else args.modes[0]
        for mode in args.modes:
            if mode != first:
                result["modes"][mode]["answers_vs_" + first] = compare(
                    answers[first], [Record(**r) for r in result["modes"][mode]["records"]])
    finally:
        if redis is not None:
            redis.stop()
    (args.out / "fleet-dynamo.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "README.md").write_text(table(result) + "\n")
    print(table(result))
    return 0


def kill_run(args, convs, opts: Options, redis, answers: dict) -> dict:
    """The workload through ``kv`` once more, the last worker SIGKILLed once ``args.kill_after`` of
    the requests were answered: failures, recovery and answers (against the reference's, or kv's)."""
    from pckernels.store.testing import free_port

    killed: dict = {}
    total = sum(len(c.questions) for c in convs)
    run_dir = Path(tempfile.mkdtemp(prefix="pc-dynamo-kill-"))
    fleet = DynamoFleet(args.dynamo_python, args.workers, "kv", run_dir, redis.url if redis else None,
                        "perf-dynamo-kill", args.budget, free_port(), tuple(args.router_arg))

    def on_done(records: list[Record]) -> None:
        if not killed and sum(r.ok for r in records) >= args.kill_after * total:
            killed["at"] = time.perf_counter()
            killed["answered"] = sum(r.ok for r in records)
            fleet.kill(args.workers - 1)

    try:
        records, wall = asyncio.run(run(fleet.url, "smollm2", convs, opts, args.limit, on_done))
        row = summary(records, wall)
        row.update(worker_hits(fleet.requests()))
    finally:
        fleet.stop()
        shutil.copy(run_dir / "frontend.log", args.out / "frontend-kill.log")
    reference = answers.get("reference") or answers.get("kv") or {}
    row["answers"] = compare(reference, records)
    row["recovery"] = recovery(records, killed["at"]) if killed else None
    row["killed_after_answers"] = killed.get("answered")
    row["records"] = [asdict(r) for r in records]
    log.info("kv, worker w%d killed: %s", args.workers - 1, row["recovery"])
    return row


def table(result: dict) -> str:
    """The README: what ran, the router modes side by side."""
    opts = result["options"]
    lines = ["# promptcache engines as Dynamo workers behind Dynamo's KV router", "",
             f"`python -m perf.fleet_dynamo {' '.join(result['argv'])}` — {result['workers']} workers (embedded "
             f"SmolLM2, fp32, one thread each, 16-token blocks, token resumption, {result['budget']} of prefix "
             "blocks each, no disk tier, " + ("a shared Redis" if result.get("remote", True) else "no Redis: private "
             "stores") + ", warmed by two prompts before serving), `dynamo.frontend` (ai-dynamo 1.6.1"
             + (" " + " ".join(result["router_args"]) if result.get("router_args") else "") + ") on loopback, fresh "
             "workers and frontend per mode; "
             f"{os.cpu_count()} CPUs visible.", "",
             f"Workload (perf.fleet's): {opts['tenants']} tenants x {opts['docs_per_tenant']} documents of "
             f"{opts['doc_tokens']} tokens, {opts['chats']} conversations of {opts['turns']} turns, "
             f"{opts['concurrency']} at a time, {opts['tokens']} new tokens, greedy, streamed. Hit rates from the "
             "workers' counts; local: less 16 tokens per block read from Redis.", "",
             "| router mode | hit rate | local hit rate | TTFT p50 | p95 | p99 | p99 after the opening | req/s | "
             "failed | requests per worker | answers equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, row in result["modes"].items():
        same = next((v for k, v in row.items() if k.startswith("answers_vs_")), None)
        lines.append(f"| {mode} | {row['hit_rate']:.1%} | {row['local_hit_rate']:.1%} | {_ms(row['ttft_p50_s'])} | "
                     f"{_ms(row['ttft_p95_s'])} | {_ms(row['ttft_p99_s'])} | {_ms(row['ttft_p99_after_opening_s'])} | "
                     f"{row['requests_per_s']:.2f} | {row['failed']} | "
                     f"{', '.join(str(v) for v in row['per_worker'].values())} | "
                     + (f"{same['same']}/{same['compared']}" if same else "(reference)") + " |")
    kv, rr = result["modes"].get("kv"), result["modes"].get("round-robin")
    if kv and rr and rr["local_hit_rate"]:
        lines += ["", f"kv / round-robin local hit rate: **{kv['local_hit_rate'] / rr['local_hit_rate']:.2f}x** (hit "
                      f"rate {kv['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x); TTFT p99 {_ms(kv['ttft_p99_s'])} vs "
                      f"{_ms(rr['ttft_p99_s'])}, after the opening {_ms(kv['ttft_p99_after_opening_s'])} vs "
                      f"{_ms(rr['ttft_p99_after_opening_s'])}, p95 {_ms(kv['ttft_p95_s'])} vs {_ms(rr['ttft_p95_s'])}."]
    kill = result.get("kill")
    if kill and kill.get("recovery"):
        rec, first = kill["recovery"], kill["recovery"]["first_ok_after_kill_s"]
        lines += ["", "## A worker killed mid-run", "",
                  f"`kv`; the last worker SIGKILLed once {kill['killed_after_answers']} answers were in. Failed "
                  f"requests: {rec['failed']} ({rec['failed_in_flight']} in flight at the kill, "
                  f"{rec['failed_after_kill_started']} started after it); retried and answered: {rec['retried_ok']}. "
                  f"Requests started after the kill: {rec['ok_after_kill']}/{rec['started_after_kill']} answered; "
                  f"first answer after the kill {'%.2f s' % first if first is not None else 'never'} after it. "
                  f"TTFT p50 {_ms(kill['ttft_p50_s'])}, p99 {_ms(kill['ttft_p99_s'])}; requests per worker "
                  f"{', '.join(str(v) for v in kill['per_worker'].values())}. Answers equal: "
                  f"{kill['answers']['same']}/{kill['answers']['compared']}."]
    lines += ["", "*answers equal*: to one `promptcache serve` replica's (no router, no Dynamo) when the run had "
                  "`--reference`, else to the first mode's."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
