"""A fleet of ``promptcache serve`` replicas behind ``vllm-router``: routing policies compared.

``python -m perf.fleet [--replicas 3] [--policies round_robin cache_aware kv_aware] [--quick] [--no-remote | --cluster]
[--kill-target replica|master] [--out DIR]``

Needs ``vllm-router`` (``pip install -e ".[fleet]"`` or ``pip install vllm-router``, a Rust binary in a
wheel; ``--router`` names its executable, default: beside this Python, on ``PATH`` or
``/work/venvs/router/bin``) and ``redis-server``. Everything runs
on loopback; see ``docs/fleet.md`` for the recipe by hand.

One fleet is started — ``--replicas`` ``promptcache serve`` processes (one thread each, the
embedded SmolLM2, ``--prefix-block 16``, a shared ``--remote`` Redis, each publishing KV events on
its own ZMQ ports) plus one more replica for the reference — and, per policy in turn,
``vllm-router --policy P`` in front of the first ``--replicas``, fed their events
(``--kv-event-source``; only ``kv_aware`` reads them). The same workload runs through each: a
bounded multi-tenant set of multi-turn chats over shared documents (each tenant has its documents;
each conversation asks a few questions about one of them, the history growing turn by turn),
``--concurrency`` conversations at a time, greedy, streamed. Each run is its own API-key tenant
(the replicas share one salt secret), so no run reuses another's blocks, on a replica or in Redis;
``kv_aware`` runs first, since the router's index would hold what later runs stored (same tokens,
other tenants). The extra replica answers the same workload directly first: the reference every
run's answers are compared with.

Reported per policy: prefix-hit rate (cached prompt tokens / prompt tokens, from each reply's
``usage``), TTFT p50/p99, requests/s, answers equal to the reference, the replicas' remote reads.
Then (``--kill``) the workload runs again through ``--kill-policy`` and one replica is SIGKILLed
once ``--kill-after`` of the requests have finished: a request that fails is retried once by the
client (as an application would); reported are the failures (all must have been in flight on the
killed replica: started before the kill), answers against the reference, and recovery — the time
from the kill to the first request that started after it and succeeded, and whether every later
request succeeded.

``--cluster``: the shared tier is a 3-master Redis Cluster on loopback (``redis+cluster://`` URL;
needs ``LocalRedisCluster``, the cluster support of ``pckernels.store``); with ``--kill-target
master`` the kill run SIGKILLs one cluster master instead of a replica (its blocks become misses:
no request may fail, no answer change).

Writes ``fleet.json`` and ``README.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from perf.server_load import start_server
from perf.suite.concurrency import percentile
from perf.suite.texts import archive, sized
from perf.suite.workloads import QUESTIONS

POLICIES = ("round_robin", "cache_aware", "kv_aware")
BLOCK = 16
"""Tokens per prefix block: ``promptcache serve --prefix-block`` and ``--kv-event-block-size``."""
TENANTS = ("Northwind Shipping", "Blue Harbour Insurance", "Kestrel Labs", "Orchard Health")
FOLLOW_UPS = ("Say that again in one short sentence.", "Which detail matters most, and why?",
              "What should I check first?", "Name one risk the text mentions.")


@dataclass
class Conversation:
    """One chat: a tenant, the shared document it is about (its system prompt) and the user turns."""

    id: int
    tenant: str
    doc: int
    system: str
    questions: list[str]


@dataclass
class Record:
    """One request's outcome (``answer`` is the assistant text that joins the history)."""

    conv: int
    turn: int
    ok: bool
    started: float
    ended: float
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    answer: str = ""
    error: str = ""
    retried: bool = False


@dataclass
class Options:
    """The workload's size."""

    tenants: int = 3
    docs_per_tenant: int = 2
    doc_tokens: int = 160
    chats: int = 12
    turns: int = 3
    tokens: int = 8
    concurrency: int = 3
    seed: int = 5


@dataclass
class Sizes:
    quick: Options = field(default_factory=lambda: Options(tenants=2, docs_per_tenant=2, doc_tokens=128, chats=8,
                                                           turns=3, tokens=6, concurrency=3))
    full: Options = field(default_factory=Options)


def workload(tokenizer, opts: Options) -> list[Conversation]:
    """The conversations: ``tenants`` x ``docs_per_tenant`` documents of ``doc_tokens`` tokens (a
    tenant's preamble + an archive text), ``chats`` conversations spread over them round-robin (so
    several conversations share each document), each with ``turns`` questions; deterministic in
    ``seed``. ``tokenizer``: sizes the documents (the embedded model's)."""
    if opts.tenants < 1 or opts.docs_per_tenant < 1 or opts.chats < 1 or opts.turns < 1:
        raise ValueError("tenants, docs_per_tenant, chats and turns must be at least 1")
    rng = random.Random(opts.seed)
    docs = []
    for t in range(opts.tenants):
        tenant = TENANTS[t % len(TENANTS)] + ("" if t < len(TENANTS) else f" {t}")
        for d in range(opts.docs_per_tenant):
            text = sized(tokenizer, archive(200 + t * 17 + d), opts.doc_tokens)
            docs.append((tenant, f"You are the assistant of {tenant}. Answer from document {d} only.\n\n{text}"))
    out = []
    for c in range(opts.chats):
        doc = c % len(docs)
        tenant, system = docs[doc]
        first = QUESTIONS[rng.randrange(len(QUESTIONS))]
        rest = [FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))] for _ in range(opts.turns - 1)]
        out.append(Conversation(c, tenant, doc, system, [first, *rest]))
    return out


def messages(conv: Conversation, answers: list[str], turn: int) -> list[dict]:
    """The chat messages of ``conv``'s turn ``turn``: system, the earlier turns with their answers, the question."""
    out = [{"role": "system", "content": conv.system}]
    for question, answer in zip(conv.questions[:turn], answers[:turn]):
        out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return out + [{"role": "user", "content": conv.questions[turn]}]


def summary(records: list[Record], wall_s: float) -> dict:
    """Hit rate, TTFT p50/p95/p99 and requests/s of the successful requests; failures counted.

    ``ttft_p99_after_opening_s``: the p99 of the requests started once the first answer was in —
    the opening wave (``--concurrency`` cold first turns at once, nothing cached anywhere, nothing
    for any policy to route on) left out; with ~100 requests the plain p99 is the second-slowest
    request, most often one of that wave."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    first_answer = min((r.ended for r in ok), default=0.0)
    later = [r.ttft_s for r in ok if r.started >= first_answer]

    def pct(values: list[float], p: float) -> float | None:
        return percentile(values, p) if values else None

    return {"requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
            "hit_rate": (sum(r.cached_tokens for r in ok) / prompt) if prompt else 0.0,
            "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in ok),
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_p99_s": pct(ttft, 99),
            "ttft_p99_after_opening_s": pct(later, 99), "after_opening": len(later),
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0, "wall_s": wall_s}


def compare(reference: dict[tuple[int, int], str], records: list[Record]) -> dict:
    """How many successful answers equal the reference's for the same (conversation, turn)."""
    ok = [r for r in records if r.ok]
    same = sum(1 for r in ok if reference.get((r.conv, r.turn)) == r.answer)
    differ = [(r.conv, r.turn) for r in ok if reference.get((r.conv, r.turn)) != r.answer]
    return {"compared": len(ok), "same": same, "differ": differ[:10]}


def recovery(records: list[Record], killed_at: float) -> dict:
    """What a replica's death cost: failed requests (and whether each was in flight at the kill),
    the time until a request started after the kill succeeded, and whether all later ones did."""
    failed = [r for r in records if not r.ok]
    after = sorted((r for r in records if r.started >= killed_at), key=lambda r: r.started)
    first_ok = min((r for r in after if r.ok), key=lambda r: r.ended, default=None)
    return {"failed": len(failed), "failed_in_flight": sum(1 for r in failed if r.started < killed_at <= r.ended),
            "failed_after_kill_started": sum(1 for r in failed if r.started >= killed_at),
            "retried_ok": sum(1 for r in records if r.retried and r.ok),
            "started_after_kill": len(after), "ok_after_kill": sum(1 for r in after if r.ok),
            "first_ok_after_kill_s": (first_ok.ended - killed_at) if first_ok else None}


async def chat(client: httpx.AsyncClient, model: str, msgs: list[dict], tokens: int) -> tuple[float, dict, str]:
    """One streamed greedy chat request: (TTFT, usage, answer text); raises on any failure."""
    body = {"model": model, "messages": msgs, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage, text = None, {}, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(str(event["error"])[:200])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = event.get("usage") or usage
    if not usage:
        raise RuntimeError("the stream ended without usage")
    return (first or time.perf_counter()) - t0, usage, "".join(text)


async def run(url: str, model: str, convs: list[Conversation], opts: Options, limit_s: float,
              on_done=None, key: str | None = None) -> tuple[list[Record], float]:
    """Every conversation, ``opts.concurrency`` at a time, turns in order; a failed turn is retried
    once. ``key``: the API key sent (``Authorization: Bearer``)."""
    records: list[Record] = []
    gate = asyncio.Semaphore(opts.concurrency)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(limit_s), headers=headers,
                                 limits=httpx.Limits(max_connections=opts.concurrency + 4)) as client:
        async def one(conv: Conversation) -> None:
            async with gate:
                answers: list[str] = []
                for turn in range(len(conv.questions)):
                    for attempt in range(2):
                        start = time.perf_counter()
                        try:
                            ttft, usage, text = await chat(client, model, messages(conv, answers, turn), opts.tokens)
                        except (httpx.HTTPError, RuntimeError) as exc:
                            records.append(Record(conv.id, turn, False, start, time.perf_counter(),
                                                  error=str(exc)[:200], retried=attempt > 0))
                            if on_done:
                                on_done(records)
                            continue
                        details = usage.get("prompt_tokens_details") or {}
                        records.append(Record(conv.id, turn, True, start, time.perf_counter(), ttft,
                                              usage.get("prompt_tokens") or 0, details.get("cached_tokens") or 0,
                                              text, retried=attempt > 0))
                        answers.append(text)
                        if on_done:
                            on_done(records)
                        break
                    else:
                        return  # the conversation cannot go on without this turn's answer

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(c) for c in convs)), limit_s)
    return records, time.perf_counter() - t0


def router_binary(given: str | None) -> str | None:
    """The ``vllm-router`` executable: ``given``, beside this Python (the ``fleet`` extra), on ``PATH``,
    or in ``/work/venvs/router/bin``."""
    beside = str(Path(sys.executable).with_name("vllm-router"))
    for path in (given, beside, shutil.which("vllm-router"), "/work/venvs/router/bin/vllm-router"):
        if path and os.path.exists(path):
            return path
    return None


def prefix_flags(resume: str = "block", chunk: int | None = None, step_tokens: int | None = None) -> list[str]:
    """``serve`` flags of the replicas' prefix reuse: ``--prefix-block`` (the router's block size),
    and where a hit resumes, how many tokens a cold read takes per forward and a scheduler step at
    most, when not the defaults."""
    flags = ["--prefix-block", str(BLOCK)]
    if resume != "block":
        flags += ["--prefix-resume", resume]
    if chunk is not None:
        flags += ["--prefix-chunk", str(chunk)]
    if step_tokens is not None:
        flags += ["--step-tokens", str(step_tokens)]
    return flags


def budget_flags(budget: str) -> list[str]:
    """``serve`` flags for a replica that keeps at most ``budget`` of KV: the prefix cache's budget,
    no store tier behind it."""
    return ["--prefix-budget", budget, "--device-budget", "0", "--host-budget", "0"]


class Fleet:
    """``n`` replicas (events on), a shared Redis, and a router in front; ``stop`` ends them all.

    ``keys``: API key -> tenant, given to every replica (``--api-keys``) with one shared salt secret,
    so a tenant's blocks are its own on every replica and in Redis — how the runs of different
    policies are kept apart on one fleet. ``prefix``: the replicas' prefix-reuse flags
    (:func:`prefix_flags`). ``routed``: how many of the replicas the router fronts
    (the first ones; default all): the others are for direct requests (the reference)."""

    def __init__(self, n: int, remote: bool, log_dir: Path, keys: dict[str, str] | None = None,
                 routed: int | None = None, cluster: bool = False, budget: str | None = None,
                 prefix: list[str] | None = None) -> None:
        from pckernels.store.testing import LocalRedis, free_port

        self.log_dir = log_dir
        self.routed = n if routed is None else routed
        if remote and cluster:
            try:
                from pckernels.store.testing import LocalRedisCluster
            except ImportError as exc:
                raise RuntimeError("--cluster needs pckernels.store.testing.LocalRedisCluster "
                                   "(the Redis Cluster support of the store)") from exc
            self.redis = LocalRedisCluster(masters=3).start()
        else:
            self.redis = LocalRedis().start() if remote else None
        self.ports = [(free_port(), free_port()) for _ in range(n)]
        self.procs: list[subprocess.Popen] = [None] * n  # type: ignore[list-item]
        self.urls: list[str] = [""] * n
        self.router: subprocess.Popen | None = None
        self.router_url = ""
        self.router_log = log_dir / "router.log"
        errors: list[BaseException] = []

        def launch(i: int) -> None:
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.ports[i][0]}",
                      "replay_endpoint": f"tcp://*:{self.ports[i][1]}", "topic": ""}
            extra = [*(prefix or prefix_flags()), "--kv-events-config", json.dumps(events)]
            if self.redis is not None:
                extra += ["--remote", self.redis.url]
            if keys:
                extra += ["--api-keys", str(key_file)]
            if budget is not None:
                extra += budget_flags(budget)
            try:
                self.procs[i], self.urls[i] = start_server("smollm2", extra)
            except BaseException as exc:  # noqa: BLE001 — reported after the join
                errors.append(exc)

        key_file = log_dir / "api-keys.json"
        if keys:
            key_file.write_text(json.dumps(keys))
        saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "PROMPTCACHE_SALT_SECRET")}
        os.environ.update(OMP_NUM_THREADS="1", PROMPTCACHE_SALT_SECRET="perf-fleet-shared-secret")
        try:
            threads = [threading.Thread(target=launch, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if errors:
            self.stop()
            raise errors[0]

    def start_router(self, binary: str, policy: str, extra: list[str] | None = None) -> str:
        """``vllm-router`` with ``policy`` over the replicas, fed their KV events (``extra``: more of its
        flags, for kv_aware only); its URL once healthy."""
        from pckernels.integration.embedded import converted_dir
        from pckernels.store.testing import free_port

        port = free_port()
        cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
               "--worker-urls", *self.urls[:self.routed], "--policy", policy, "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--log-level", "debug" if policy == "kv_aware" else "info"]
        if policy == "kv_aware":  # the router refuses event sources for any other policy
            cmd += extra or []
            cmd += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", "smollm2"]
            for url, (events, replay) in zip(self.urls[:self.routed], self.ports):
                cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}",
                        "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{replay}"]
        env = {**os.environ, "VLLM_ROUTER_TOKENIZER": str(converted_dir())}
        self.router_log = self.log_dir / f"router-{policy}-{port}.log"
        log = open(self.router_log, "w")
        self.router = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.router_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.router.returncode}; see {log.name}")
            try:
                if httpx.get(self.router_url + "/health", timeout=2).status_code == 200:
                    return self.router_url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("vllm-router did not become healthy")

    def metric(self, name: str, label: str | None = None) -> float:
        """``name`` summed over the live replicas (the samples whose label value is ``label``, if given)."""
        return sum(self.metric_of(i, name, label) for i, proc in enumerate(self.procs)
                   if proc is not None and proc.poll() is None)

    def metric_of(self, i: int, name: str, label: str | None = None) -> float:
        """``name`` on replica ``i`` alone (see :meth:`metric`)."""
        return self.counters_of(i, [(name, label)])[0]

    def counters_of(self, i: int, counters) -> list[float]:
        """Each ``(name, label)`` of ``counters`` on replica ``i``, from one scrape of its ``/metrics``."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.urls[i] + "/metrics", timeout=10).text
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
        return [sum(s.value for s in samples if s.name == name and (label is None or label in s.labels.values()))
                for name, label in counters]

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)

    def kill_master(self) -> None:
        """SIGKILL the shared tier's first cluster master (its keys are lost; the others serve on)."""
        self.redis.kill(0)

    def stop_router(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(30)
            except subprocess.TimeoutExpired:
                self.router.kill()
        self.router = None

    def stop(self) -> None:
        for proc in ([self.router] if self.router else []) + [p for p in self.procs if p is not None]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in ([self.router] if self.router else []) + [p for p in self.procs if p is not None]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.redis is not None:
            self.redis.stop()


def decisions(log: Path) -> dict:
    """kv_aware's routing decisions in a router's debug log: outcomes counted, credited tokens summed."""
    import re

    outcomes: dict[str, int] = {}
    credited = 0
    for line in log.read_text(errors="replace").splitlines():
        if "KV prefix decision" not in line:
            continue
        plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
        outcome = re.search(r'outcome="([a-z_]+)"', plain)
        if outcome:
            outcomes[outcome.group(1)] = outcomes.get(outcome.group(1), 0) + 1
        tokens = re.search(r"credited_prefix_tokens=([0-9]+)", plain)
        credited += int(tokens.group(1)) if tokens else 0
    return {"outcomes": outcomes, "credited_tokens": credited}


def warmup_text(i: int) -> str:
    """The ``i``-th warm-up prompt (longer each round) a replica or worker reads before it is measured."""
    return f"Warm-up {i}: " + "Count the rivers, the lanterns and the harbours. " * (12 * (i + 1))


def warm(urls: list[str], key: str, rounds: int = 2) -> None:
    """Short chats straight to each replica before any measured run, as their own tenant (``key``):
    a replica's first forwards (allocations, oneDNN primitives, the arena's first growth) are paid
    here, not by whichever policy is measured first."""
    async def go() -> None:
        for url in urls:
            async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
                for i in range(rounds):
                    await chat(client, "smollm2", [{"role": "user", "content": warmup_text(i)}], 4)

    asyncio.run(go())


def measure(fleet: Fleet, url: str, convs: list[Conversation], opts: Options, limit_s: float, key: str,
            on_done=None) -> dict:
    """One workload run through ``url``; the replicas' Redis reads are deltas over the replicas still
    alive at the end (a killed one's counters are gone)."""
    counters = (("promptcache_remote_bytes_total", "read"), ("promptcache_store_hits_total", "remote"),
                ("promptcache_prefix_evictions_total", None))
    before = [fleet.counters_of(i, counters) for i in range(len(fleet.urls))]
    records, wall = asyncio.run(run(url, "smollm2", convs, opts, limit_s, on_done, key))
    row = summary(records, wall)
    alive = [i for i, p in enumerate(fleet.procs) if p.poll() is None]
    after = {i: fleet.counters_of(i, counters) for i in alive}
    row["remote_mib_read"] = sum(after[i][0] - before[i][0] for i in alive) / 2**20
    row["remote_blocks"] = sum(after[i][1] - before[i][1] for i in alive)
    row["prefix_evictions"] = sum(after[i][2] - before[i][2] for i in alive)
    # prefix blocks are full BLOCK-token blocks: what the replicas held themselves, Redis reads taken out
    row["local_hit_rate"] = (max(0.0, row["cached_tokens"] - BLOCK * row["remote_blocks"]) / row["prompt_tokens"]
                             if row["prompt_tokens"] else 0.0)
    row["records"] = [asdict(r) for r in records]
    if fleet.router is not None:
        row["router_decisions"] = decisions(fleet.router_log)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=["kv_aware", "cache_aware", "round_robin"],
                    help="in this order on one fleet (kv_aware first: later runs' events would mislead it)")
    ap.add_argument("--quick", action="store_true", help="a few minutes: fewer, shorter conversations")
    ap.add_argument("--tenants", type=int, help="tenants (default: the size's)")
    ap.add_argument("--docs-per-tenant", type=int, help="documents per tenant")
    ap.add_argument("--chats", type=int, help="conversations (spread over the documents round-robin)")
    ap.add_argument("--turns", type=int)
    ap.add_argument("--doc-tokens", type=int)
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--tokens", type=int, help="new tokens per answer")
    ap.add_argument("--no-remote", action="store_true", help="private stores (no shared Redis)")
    ap.add_argument("--cluster", action="store_true", help="the shared tier is a 3-master Redis Cluster")
    ap.add_argument("--replica-budget", metavar="SIZE",
                    help="KV bytes one replica keeps (e.g. 96MiB: its --prefix-budget, with no device or host tier "
                         "behind it); default: the server's (1 GiB prefix cache + store tiers), more than the "
                         "workload needs")
    ap.add_argument("--prefix-resume", choices=("block", "token"), default="block",
                    help="the replicas' --prefix-resume: block (bitwise hits, cold prompts read in 16-token "
                         "forwards) or token (hits equal to rounding, cold prompts read in 256-token forwards)")
    ap.add_argument("--prefix-chunk", type=int, help="the replicas' --prefix-chunk (default: the server's)")
    ap.add_argument("--step-tokens", type=int, help="the replicas' --step-tokens (default: the server's)")
    ap.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                    help="two short chats straight to every replica before the measured runs, as their own "
                         "tenant, so the policy measured first does not pay the replicas' first forwards "
                         "(default on; runs before this option had none)")
    ap.add_argument("--kill-target", choices=("replica", "master"), default="replica",
                    help="what the kill run SIGKILLs: the last replica, or a cluster master (--cluster)")
    ap.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                    help="the replica-death run (default on)")
    ap.add_argument("--kill-policy", choices=POLICIES, default="kv_aware")
    ap.add_argument("--kill-after", type=float, default=0.4, help="share of requests finished before the kill")
    ap.add_argument("--router", help="the vllm-router executable")
    ap.add_argument("--kv-aware-args", default="",
                    help="more vllm-router flags for the kv_aware runs, one string (e.g. '--router-temperature 0.5')")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds one workload run may take")
    ap.add_argument("--out", type=Path, default=Path("perf/results/cpu-2c/fleet"))
    args = ap.parse_args(argv)
    if args.cluster and args.no_remote:
        ap.error("--cluster and --no-remote exclude each other")
    if args.kill_target == "master" and not args.cluster:
        ap.error("--kill-target master needs --cluster")
    binary = router_binary(args.router)
    if binary is None:
        print("vllm-router is not installed (pip install vllm-router); see docs/fleet.md", file=sys.stderr)
        return 2
    opts = Sizes().quick if args.quick else Sizes().full
    for name in ("tenants", "docs_per_tenant", "chats", "turns", "doc_tokens", "concurrency", "tokens"):
        if getattr(args, name) is not None:
            setattr(opts, name, getattr(args, name))

    from pckernels.integration.embedded import load_tokenizer

    convs = workload(load_tokenizer(), opts)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    replica_prefix = prefix_flags(args.prefix_resume, args.prefix_chunk, args.step_tokens)
    result: dict = {"argv": sys.argv[1:], "options": asdict(opts), "replicas": args.replicas,
                    "remote": not args.no_remote, "cluster": args.cluster, "kill_target": args.kill_target,
                    "replica_budget": args.replica_budget, "kv_aware_args": args.kv_aware_args,
                    "prefix_flags": replica_prefix,
                    "router": _router_version(binary), "policies": {}}
    t_all = time.perf_counter()
    runs = ["warmup", "reference", *args.policies] + (["kill"] if args.kill and args.replicas >= 2 else [])
    keys = {f"perf-fleet-{run}-key": f"run-{run}" for run in runs}
    # one fleet: the routed replicas plus one more for the reference, every run its own tenant
    fleet = Fleet(args.replicas + 1, not args.no_remote, logs, keys, routed=args.replicas, cluster=args.cluster,
                  budget=args.replica_budget, prefix=replica_prefix)
    result["warm"] = args.warm
    try:
        if args.warm:
            warm(fleet.urls, "perf-fleet-warmup-key")
        row = measure(fleet, fleet.urls[-1], convs, opts, args.limit, "perf-fleet-reference-key")
        reference = {(r["conv"], r["turn"]): r["answer"] for r in row["records"] if r["ok"]}
        result["single"] = row
        _report("single replica, no router", row)
        for policy in args.policies:
            url = fleet.start_router(binary, policy, args.kv_aware_args.split())
            try:
                row = measure(fleet, url, convs, opts, args.limit, f"perf-fleet-{policy}-key")
            finally:
                fleet.stop_router()
            row["answers"] = compare(reference, [Record(**r) for r in row["records"]])
            result["policies"][policy] = row
            _report(policy, row)
            _write(args.out, result)
        if "kill" in runs:
            killed: dict = {}
            total = sum(len(c.questions) for c in convs)
            victim = args.replicas - 1

            def on_done(records: list[Record]) -> None:
                if not killed and sum(r.ok for r in records) >= args.kill_after * total:
                    killed["at"] = time.perf_counter()
                    killed["answered"] = sum(r.ok for r in records)
                    fleet.kill_master() if args.kill_target == "master" else fleet.kill(victim)

            url = fleet.start_router(binary, args.kill_policy, args.kv_aware_args.split())
            row = measure(fleet, url, convs, opts, args.limit, "perf-fleet-kill-key", on_done)
            records = [Record(**r) for r in row["records"]]
            row["answers"] = compare(reference, records)
            row["recovery"] = recovery(records, killed["at"]) if killed else None
            row["killed_after_answers"] = killed.get("answered")
            if args.cluster:  # the live replicas' errors against the dead master (proof the kill was felt)
                time.sleep(1.0)
                row["cluster_node_errors"] = fleet.metric("promptcache_remote_cluster_node_errors_total")
            row["policy"] = args.kill_policy
            row["target"] = args.kill_target
            result["kill"] = row
            _report(f"{args.kill_policy}, {'a cluster master' if args.kill_target == 'master' else f'replica {victim}'}"
                    " killed", row)
    finally:
        fleet.stop()
    result["wall_s"] = time.perf_counter() - t_all
    _write(args.out, result)
    print(f"wrote {args.out}/README.md ({result['wall_s']:.0f} s)")
    return 0


def _router_version(binary: str) -> str:
    """``vllm-router X.Y.Z`` from the package beside ``binary`` (the binary has no ``--version``)."""
    python = Path(binary).with_name("python")
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
                             capture_output=True, text=True, timeout=60)
        return f"vllm-router {out.stdout.strip()}" if out.returncode == 0 else "vllm-router"
    except (OSError, subprocess.TimeoutExpired):
        return "vllm-router"


def _report(name: str, row: dict) -> None:
    p50 = row["ttft_p50_s"] or 0.0
    p99 = row["ttft_p99_s"] or 0.0
    same = row.get("answers")
    print(f"{name:32s} hit {row['hit_rate']:6.1%}  TTFT p50 {p50 * 1e3:6.0f} ms p99 {p99 * 1e3:6.0f} ms  "
          f"{row['requests_per_s']:5.2f} req/s  failed {row['failed']}"
          + (f"  same answers {same['same']}/{same['compared']}" if same else ""), flush=True)


def table(result: dict) -> str:
    """The README: what ran, the policies side by side, the replica-death run."""
    opts = result["options"]
    lines = ["# promptcache replicas behind vllm-router", "",
             f"`python -m perf.fleet {' '.join(result['argv'])}` — {result['replicas']} `promptcache serve` replicas "
             f"(embedded SmolLM2-135M, fp32, one thread each, `{' '.join(result.get('prefix_flags') or prefix_flags())}`, "
             "KV events on"
             f"{_shared(result)}{_budget(result)}"
             + ("; each warmed by two short chats first" if result.get("warm") else "")
             + f"), router `{result['router']}`"
             + (f" (kv_aware with `{result['kv_aware_args']}`)" if result.get("kv_aware_args") else "") + ", "
             f"{os.cpu_count()} CPUs visible (shared with other work: compare rows, not runs).", "",
             f"Workload: {opts['tenants']} tenants x {opts['docs_per_tenant']} documents of {opts['doc_tokens']} "
             f"tokens, {opts['chats']} conversations of {opts['turns']} turns ({opts['chats'] * opts['turns']} "
             f"requests), {opts['concurrency']} conversations at a time, {opts['tokens']} new tokens, greedy, "
             "streamed. Hit rate: cached prompt tokens / prompt tokens (`usage`; blocks read from Redis count "
             f"as cached); local hit rate: the same less {BLOCK} tokens per block the replicas read from Redis "
             "(`promptcache_store_hits_total{tier=\"remote\"}`). All runs on one fleet, each as its own "
             "API-key tenant (its blocks its own on every replica and in Redis); the reference is one more "
             "replica, not behind the router. Policies ran in the table's order, each behind a router "
             "started for it. *Credited*: prompt tokens kv_aware's router counted as cached on the worker it chose "
             "(its debug log).", "",
             "*TTFT p99 after the opening*: the p99 of the requests started once the first answer was in (the "
             "opening wave of cold first turns, which no policy can place on a cache, left out).", "",
             "| run | hit rate | local hit rate | TTFT p50 | TTFT p95 | TTFT p99 | p99 after the opening | req/s | "
             "failed | answers = single replica's | MiB from Redis | prefix evictions | credited |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [("single replica, no router", result.get("single"))]
    rows += [(p, r) for p, r in result.get("policies", {}).items()]
    if result.get("kill"):
        rows.append((f"{result['kill']['policy']}, {_victim(result['kill'])} killed", result["kill"]))
    for name, r in rows:
        if not r:
            continue
        same = r.get("answers")
        answers = f"{same['same']}/{same['compared']}" if same else "(reference)"
        local = f"{r['local_hit_rate']:.1%}" if "local_hit_rate" in r else "–"
        lines.append(f"| {name} | {r['hit_rate']:.1%} | {local} | {_ms(r.get('ttft_p50_s'))} | "
                     f"{_ms(r.get('ttft_p95_s'))} | {_ms(r.get('ttft_p99_s'))} | {_ms(r.get('ttft_p99_after_opening_s'))} | "
                     f"{r['requests_per_s']:.2f} | {r['failed']} | {answers} | "
                     f"{r.get('remote_mib_read', 0):.1f} | {r.get('prefix_evictions', 0):.0f} | {_credited(r)} |")
    pol = result.get("policies", {})
    if "kv_aware" in pol and "round_robin" in pol and pol["round_robin"]["hit_rate"]:
        kv, rr = pol["kv_aware"], pol["round_robin"]
        local = (f", local hit rate **{kv['local_hit_rate'] / rr['local_hit_rate']:.2f}x**"
                 if rr.get("local_hit_rate") else "")
        lines += ["", f"kv_aware / round_robin hit rate: **{kv['hit_rate'] / rr['hit_rate']:.2f}x**{local} "
                  "(target >= 2x); "
                  f"TTFT p99 {_ms(kv.get('ttft_p99_s'))} vs {_ms(rr.get('ttft_p99_s'))} (target: lower); after the "
                  f"opening {_ms(kv.get('ttft_p99_after_opening_s'))} vs {_ms(rr.get('ttft_p99_after_opening_s'))}; "
                  f"p95 {_ms(kv.get('ttft_p95_s'))} vs {_ms(rr.get('ttft_p95_s'))}."]
    kill = result.get("kill")
    if kill and kill.get("recovery"):
        rec = kill["recovery"]
        first = rec["first_ok_after_kill_s"]
        lines += ["", f"## {_victim(kill)[0].upper() + _victim(kill)[1:]} killed mid-run", "",
                  f"`{kill['policy']}`; {_victim(kill, the=True)} SIGKILLed once {kill.get('killed_after_answers')} "
                  "of the "
                  f"{kill['requests'] - rec['failed']} answers were in. Failed requests: {rec['failed']} "
                  f"({rec['failed_in_flight']} in flight at the kill, {rec['failed_after_kill_started']} started "
                  f"after it); retried and answered: {rec['retried_ok']}. Requests started after the kill: "
                  f"{rec['ok_after_kill']}/{rec['started_after_kill']} answered; first answer after the kill "
                  f"{'%.2f s' % first if first is not None else 'never'} after it. Answers equal to the single "
                  f"replica's: {kill['answers']['same']}/{kill['answers']['compared']}."
                  + (f" Cluster node errors counted by the replicas (`promptcache_remote_cluster_node_errors_total`):"
                     f" {kill['cluster_node_errors']:.0f}." if "cluster_node_errors" in kill else "")]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _shared(result: dict) -> str:
    if not result["remote"]:
        return ", private stores"
    return ", a shared 3-master Redis Cluster" if result.get("cluster") else ", a shared Redis"


def _budget(result: dict) -> str:
    budget = result.get("replica_budget")
    if not budget:
        return ""
    return f", each replica keeping at most {budget} of KV (`{' '.join(budget_flags(budget))}`)"


def _victim(kill: dict, the: bool = False) -> str:
    if kill.get("target") == "master":
        return "one Redis Cluster master (of 3)" if not the else "the first Redis Cluster master"
    return "one replica" if not the else "the last replica"


def _credited(row: dict) -> str:
    d = row.get("router_decisions") or {}
    if not d.get("outcomes"):
        return "–"
    return f"{d['credited_tokens']} ({', '.join(f'{k} {v}' for k, v in sorted(d['outcomes'].items()))})"


def _write(out: Path, result: dict) -> None:
    (out / "fleet.json").write_text(json.dumps(result, indent=1))
    (out / "README.md").write_text(table(result))


if __name__ == "__main__":
    raise SystemExit(main())
