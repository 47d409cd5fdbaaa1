"""A bounded load generator for ``promptcache serve`` on loopback (asyncio + httpx).

``python -m perf.server_load [--clients 1 2 4 8 16] [--requests 2] [--tokens 16] [--workloads rag template]``

Starts ``promptcache serve`` on the embedded model (or uses ``--url``), uploads each workload's
schema, and replays the workload from ``N`` concurrent clients (closed loop: each client sends
``--requests`` streamed chat requests back to back). Every cell runs three ways against the same
server, interleaved per ``N``:

* ``prompt_cache``: the PML prompt in the ``pml`` extension field (modules reused);
* ``prefix``: the same text as plain chat messages, modules concatenated in the order an
  application would (retrieval order), with the server's exact prefix reuse — what vLLM, SGLang
  or llama.cpp's prompt cache would give;
* ``no_reuse``: the same plain messages with ``"cache": false``.

``--peer URL --peer-model NAME`` adds the plain messages against another OpenAI-compatible server
(llama.cpp's ``llama_cpp.server`` with its prompt cache on, say) as a fourth column.

Workloads (from ``perf.suite.workloads``' texts): ``rag`` — k of N passages in a new order per
request; ``template`` — a long system prompt plus a reply template with four arguments. Every
request's passage choice is fresh, so exact repeats do not flatter prefix reuse.

Reported per workload, method and ``N``: requests/s (requests over the cell's wall time), TTFT
p50/p99 (request sent to the first content token received) and end-to-end p50/p99, with the
server-reported cached tokens; a 429 (queue full) is retried after its ``Retry-After`` and counted in
``busy_retries`` (the shipped server run uses ``--max-queue 4096``, so none occur there). Writes ``server_load.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from perf.suite.concurrency import percentile
from perf.suite.texts import archive, guidelines, pml_escape, sized
from perf.suite.workloads import CUSTOMERS, QUESTIONS

METHODS = ("prompt_cache", "prefix", "no_reuse")
MAX_BUSY_RETRIES = 100
"""A 429 (queue full) is retried after its Retry-After (at most 1 s), counted in ``busy``."""
RAG_SYSTEM = "Answer using only the retrieved passages.\n"
SHOP_SYSTEM = "You are the support assistant of a shop. "


@dataclass
class Query:
    pml: str
    messages: list[dict]


class Workload:
    """Schema text plus a generator of fresh queries (PML and the equivalent plain messages)."""

    def __init__(self, name: str, schema: str, make) -> None:
        self.name, self.schema, self._make = name, schema, make
        self._count = 0

    def next(self) -> Query:
        self._count += 1
        return self._make(self._count)


def rag_workload(tokenizer, docs: int, doc_tokens: int, k: int, seed: int = 7) -> Workload:
    texts = [sized(tokenizer, archive(100 + i), doc_tokens) for i in range(docs)]
    passages = [f"Passage {i}: {t}\n" for i, t in enumerate(texts)]
    modules = "".join(f'<module name="doc{i}">{pml_escape(p)}</module>' for i, p in enumerate(passages))
    schema = f'<schema name="load-rag"><system>{pml_escape(RAG_SYSTEM)}{modules}</system></schema>'
    rng = random.Random(seed)

    def make(i: int) -> Query:
        picked = rng.sample(range(docs), k)
        question = QUESTIONS[i % len(QUESTIONS)]
        pml = (f'<prompt schema="load-rag">{"".join(f"<doc{j}/>" for j in picked)}<user>{pml_escape(question)}'
               f'</user><assistant/></prompt>')
        system = RAG_SYSTEM + "".join(passages[j] for j in picked)
        return Query(pml, [{"role": "system", "content": system}, {"role": "user", "content": question}])

    return Workload(f"rag ({k} of {docs} passages of {doc_tokens} tokens)", schema, make)


def template_workload(tokenizer, system_tokens: int) -> Workload:
    rules = sized(tokenizer, guidelines(3), system_tokens)
    reply = ("Write a reply to {customer} about their {product} order in a {tone} tone, quoting the order number "
             "{order} and apologising for the delay.")
    slots = {name: f'<param name="{name}" len="{n}"/>' for name, n in
             (("customer", 8), ("product", 8), ("tone", 4), ("order", 12))}
    schema = (f'<schema name="load-template"><system>{pml_escape(SHOP_SYSTEM + rules)}</system>'
              f'<user><module name="reply">{reply.format(**slots)}</module></user></schema>')

    def make(i: int) -> Query:
        customer, product, tone, order = CUSTOMERS[i % len(CUSTOMERS)]
        order = f"{order}-{i}"
        args = dict(customer=customer, product=product, tone=tone, order=order)
        pml = ('<prompt schema="load-template"><reply ' + " ".join(f'{k}="{v}"' for k, v in args.items())
               + '/><assistant/></prompt>')
        return Query(pml, [{"role": "system", "content": SHOP_SYSTEM + rules},
                           {"role": "user", "content": reply.format(**args)}])

    return Workload(f"template ({system_tokens}-token system prompt, 4 arguments)", schema, make)


async def one_request(client: httpx.AsyncClient, model: str, method: str, query: Query, tokens: int) -> dict:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if method == "prompt_cache":
        body.update(messages=[], pml=query.pml)
    else:
        body["messages"] = query.messages
        if method == "no_reuse":
            body["cache"] = False
    t0 = time.perf_counter()
    busy = 0
    while True:
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code == 429 and busy < MAX_BUSY_RETRIES:
                busy += 1
                await asyncio.sleep(min(1.0, float(reply.headers.get("retry-after", "1"))))
                continue
            if reply.status_code != 200:
                raise RuntimeError(f"{method}: HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
            first, usage = await _read_events(reply, method)
            break
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": (first or end) - t0, "e2e_s": end - t0, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "busy": busy}


async def _read_events(reply: httpx.Response, method: str) -> tuple[float | None, dict]:
    """Read an SSE reply: when its first content token arrived, and its usage."""
    first, usage = None, {}
    async for line in reply.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"{method}: {event['error']}")
        choices = event.get("choices") or []
        if first is None and choices and (choices[0].get("delta") or {}).get("content"):
            first = time.perf_counter()
        if event.get("usage"):
            usage = event["usage"]
    return first, usage


async def cell(url: str, model: str, method: str, workload: Workload, clients: int, requests: int,
               tokens: int, limit_s: float) -> dict:
    queries = [[workload.next() for _ in range(requests)] for _ in range(clients)]
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(limit_s), limits=httpx.Limits(
            max_connections=clients + 4)) as client:
        async def run_client(mine: list[Query]) -> None:
            for query in mine:
                results.append(await one_request(client, model, method, query, tokens))

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(run_client(q) for q in queries)), limit_s)
        wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] for r in results]
    e2e = [r["e2e_s"] for r in results]
    return {"method": method, "clients": clients, "requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
            "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] or 0 for r in results),
            "mean_cached_tokens": statistics.fmean(r["cached_tokens"] or 0 for r in results),
            "tokens_per_s": sum(r["completion_tokens"] or 0 for r in results) / wall,
            "busy_retries": sum(r["busy"] for r in results), "ttft_samples_s": ttft}


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.environ.get("PROMPTCACHE_LOAD_LOG", os.devnull), "w")
    proc = subprocess.Popen([sys.executable, "-m", "pckernels.cli", "serve", "--model", model, "--port", str(port),
                             "--memory-only", "--max-queue", "4096", "--request-timeout", "0", "--log-level",
                             "warning", *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready")


def upload(url: str, schema: str) -> None:
    reply = httpx.post(url + "/v1/schemas", json={"pml": schema}, timeout=60)
    reply.raise_for_status()
    name = reply.json()["name"]
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/schemas/{name}", timeout=10).json()["status"]
        if status == "ready":
            return
        if status == "failed":
            raise RuntimeError(f"schema {name} failed to encode")
        time.sleep(0.2)
    raise RuntimeError(f"schema {name} did not encode in time")


def summary(rows: list[dict], args) -> str:
    lines = ["# promptcache serve under load (loopback)", "",
             f"`python -m perf.server_load {' '.join(sys.argv[1:])}` — {args.requests} streamed chat requests per "
             f"client back to back, {args.tokens} new tokens each, greedy; the server on the embedded model "
             f"({os.cpu_count()} CPUs visible). TTFT: request sent to first content token received.", ""]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += [f"## {workload}", "",
                  "| clients | method | req/s | vs no reuse | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | prompt tok | cached tok |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        mine = [r for r in rows if r["workload"] == workload]
        for n in dict.fromkeys(r["clients"] for r in mine):
            base = next((r for r in mine if r["clients"] == n and r["method"] == "no_reuse"), None)
            for r in (r for r in mine if r["clients"] == n):
                speed = f"{r['requests_per_s'] / base['requests_per_s']:.2f}x" if base else "–"
                lines.append(f"| {n} | {r['method']} | {r['requests_per_s']:.2f} | {speed} | "
                             f"{r['ttft_p50_s'] * 1e3:.0f} ms | {r['ttft_p99_s'] * 1e3:.0f} ms | "
                             f"{r['e2e_p50_s'] * 1e3:.0f} ms | {r['e2e_p99_s'] * 1e3:.0f} ms | "
                             f"{r['mean_prompt_tokens']:.0f} | {r['mean_cached_tokens']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def _write(out: Path, rows: list[dict], metrics: str | None, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_load.json").write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))
    (out / "summary.md").write_text(summary(rows, args))
    if metrics is not None:
        (out / "metrics.txt").write_text(metrics)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.server_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per client per cell")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per request")
    ap.add_argument("--workloads", nargs="+", choices=("rag", "template"), default=["rag", "template"])
    ap.add_argument("--rag", type=int, nargs=3, default=[8, 256, 4], metavar=("DOCS", "DOC_TOKENS", "K"))
    ap.add_argument("--template-tokens", type=int, default=512)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--url", help="an already running promptcache server (default: start one)")
    ap.add_argument("--peer", help="another OpenAI-compatible server, sent the plain messages")
    ap.add_argument("--peer-model", default="default")
    ap.add_argument("--cell-limit", type=float, default=900.0, help="seconds one cell may take")
    ap.add_argument("--out", type=Path, default=Path("perf/results/cpu-2c/server-load"))
    args = ap.parse_args(argv)

    from pckernels.integration.embedded import load_tokenizer

    tokenizer = load_tokenizer()
    builders = {"rag": lambda: rag_workload(tokenizer, *args.rag),
                "template": lambda: template_workload(tokenizer, args.template_tokens)}
    proc, url = (None, args.url) if args.url else start_server(args.model, [])
    model = args.model
    rows: list[dict] = []
    try:
        for name in args.workloads:
            workload = builders[name]()
            upload(url, workload.schema)
            targets = [(m, url, model) for m in args.methods]
            if args.peer:
                targets.append(("peer", args.peer, args.peer_model))
            for method, target, target_model in targets:
                asyncio.run(cell(target, target_model, "prefix" if method == "peer" else method, workload, 1, 1,
                                 args.tokens, args.cell_limit))
            for i, n in enumerate(args.clients):
                order = targets[i % len(targets):] + targets[:i % len(targets)]
                for method, target, target_model in order:
                    row = asyncio.run(cell(target, target_model, "prefix" if method == "peer" else method, workload,
                                           n, args.requests, args.tokens, args.cell_limit))
                    row.update(method=method, workload=workload.name)
                    rows.append(row)
                    _write(args.out, rows, None, args)
                    print(f"{name:9s} N={n:2d} {method:13s} {row['requests_per_s']:6.2f} req/s  TTFT p50 "
                          f"{row['ttft_p50_s'] * 1e3:7.0f} ms p99 {row['ttft_p99_s'] * 1e3:7.0f} ms  cached "
                          f"{row['mean_cached_tokens']:.0f}/{row['mean_prompt_tokens']:.0f}", flush=True)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    _write(args.out, rows, metrics, args)
    print(f"wrote {args.out}/summary.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
