"""The remote tier on one Redis vs a three-master Redis Cluster, on loopback, interleaved.

``python -m perf.bench_remote_cluster [--blocks 48] [--mib 1.5] [--repeats 3] [--out DIR]``

Needs ``redis-server`` and ``redis-cli`` (both started here on free loopback ports, nothing
persisted). Per repeat, for one server and for the cluster in turn (same blocks, fresh namespace):
``--blocks`` blocks of ``--mib`` MiB (fp16, a SmolLM2-135M module of ~80 tokens is ~3.5 MiB in
fp32) are queued with ``write_behind`` and flushed (upload time), then read back and verified
(read time, per-block latency). Then, on the cluster only, the master holding most blocks is
SIGKILLed and every block is read twice: the first pass pays one refused connection for the dead
master (then its back-off), the second mostly finds it in back-off (one probe per back-off
period); reported: the time of each pass,
the misses, and whether every block that was read equals what was written. Medians over repeats;
the ratios matter (the machine is shared), not the absolute times.

Writes ``bench_remote_cluster.json`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _blocks(n: int, mib: float) -> dict:
    from pckernels.store import BlockKey

    tokens = max(1, int(mib * 2**20 / (30 * 2 * 3 * 64 * 2)))
    shape = (30, 2, 3, tokens, 64)  # SmolLM2-135M's layers, KV heads and head size, fp16
    gen = torch.Generator().manual_seed(5)
    return {BlockKey(f"{i:08x}" * 8, schema="bench", module=f"m{i}", shape=shape, dtype=torch.float16):
            torch.randn(shape, generator=gen).to(torch.float16) for i in range(n)}


def _round_trip(url: str, namespace: str, blocks: dict) -> dict:
    from pckernels.store import RemoteTier

    tier = RemoteTier(url, namespace=namespace)
    tier.contains(next(iter(blocks)))  # connect (and detect the mode) outside the timing
    t0 = time.perf_counter()
    for k, b in blocks.items():
        tier.write_behind(k, b, b.numel() * b.element_size())
    assert tier.flush(300)
    write_s = time.perf_counter() - t0
    latencies = []
    t0 = time.perf_counter()
    same = True
    for k, b in blocks.items():
        t1 = time.perf_counter()
        got = tier.read(k)
        latencies.append(time.perf_counter() - t1)
        same = same and got is not None and torch.equal(got, b)
    read_s = time.perf_counter() - t0
    tier.close()
    nbytes = sum(b.numel() * b.element_size() for b in blocks.values())
    return {"write_s": write_s, "read_s": read_s, "write_MBps": nbytes / write_s / 1e6,
            "read_MBps": nbytes / read_s / 1e6, "read_p50_ms": statistics.median(latencies) * 1e3,
            "read_max_ms": max(latencies) * 1e3, "same": same}


def _dead_master(cluster, namespace: str, blocks: dict) -> dict:
    from pckernels.store import RemoteTier

    tier = RemoteTier(cluster.url, namespace=namespace)
    client = cluster.client()
    holders = [cluster.node_of(tier.meta_key(k.digest), client) for k in blocks]
    client.close()
    victim = max(set(holders), key=holders.count)
    tier.contains(next(iter(blocks)))
    cluster.kill(victim)
    out = {"victim_blocks": holders.count(victim)}
    for name in ("first_pass", "in_backoff"):
        t0 = time.perf_counter()
        got = {k: tier.read(k) for k in blocks}
        out[f"{name}_s"] = time.perf_counter() - t0
        out[f"{name}_misses"] = sum(v is None for v in got.values())
        out[f"{name}_exact"] = all(v is None or torch.equal(v, blocks[k]) for k, v in got.items())
    stats = tier.describe()
    out["node_errors"] = sum(stats["cluster"]["node_errors"].values())
    tier.close(timeout_s=0)
    cluster.restart(victim)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_remote_cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--mib", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("perf/results/cpu-2c/remote-cluster"))
    args = ap.parse_args(argv)
    from pckernels.store.testing import LocalRedis, LocalRedisCluster

    torch.set_num_threads(1)
    blocks = _blocks(args.blocks, args.mib)
    rows: dict[str, list] = {"single": [], "cluster": [], "dead_master": []}
    with LocalRedis() as single, LocalRedisCluster() as cluster:
        for r in range(args.repeats):
            for mode, url in (("single", single.url), ("cluster", cluster.url)) if r % 2 == 0 else \
                    (("cluster", cluster.url), ("single", single.url)):
                rows[mode].append(_round_trip(url, f"bench{r}", blocks))
            rows["dead_master"].append(_dead_master(cluster, f"bench{r}", blocks))
            print(f"repeat {r}: " + ", ".join(f"{m} write {rows[m][-1]['write_MBps']:.0f} MB/s read "
                                              f"{rows[m][-1]['read_MBps']:.0f} MB/s" for m in ("single", "cluster")),
                  flush=True)
    med = {m: {f: statistics.median(row[f] for row in rows[m]) for f in rows[m][0] if f != "same"}
           for m in ("single", "cluster")}
    dead = {f: statistics.median(row[f] for row in rows["dead_master"]) for f in rows["dead_master"][0]
            if not f.endswith("exact")}
    result = {"argv": argv, "blocks": args.blocks, "mib": args.mib, "rows": rows, "median": med,
              "dead_master_median": dead,
              "all_exact": all(row["same"] for m in ("single", "cluster") for row in rows[m])
              and all(row["first_pass_exact"] and row["in_backoff_exact"] for row in rows["dead_master"])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_remote_cluster.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Remote tier: one Redis vs a 3-master cluster ({args.blocks} blocks x {args.mib} MiB, "
             f"median of {args.repeats})", "", "| server | upload MB/s | read MB/s | read p50 ms | read max ms |",
             "| --- | --- | --- | --- | --- |"]
    for m in ("single", "cluster"):
        lines.append(f"| {m} | {med[m]['write_MBps']:.0f} | {med[m]['read_MBps']:.0f} | {med[m]['read_p50_ms']:.2f} "
                     f"| {med[m]['read_max_ms']:.1f} |")
    lines += ["", f"A master killed (holding {dead['victim_blocks']:.0f} of {args.blocks} blocks): first pass over "
              f"every block {dead['first_pass_s'] * 1e3:.0f} ms with {dead['first_pass_misses']:.0f} misses, "
              f"second pass {dead['in_backoff_s'] * 1e3:.0f} ms with "
              f"{dead['in_backoff_misses']:.0f} misses (the dead master's blocks miss without a call while it "
              f"backs off, one probe per back-off period); {dead['node_errors']:.0f} node error(s) counted over "
              f"both passes. Every block read equals what was written: {result['all_exact']}.", "",
              "Per repeat (MB/s, upload / read): " + "; ".join(
                  f"single {s['write_MBps']:.0f} / {s['read_MBps']:.0f}, cluster {c['write_MBps']:.0f} / "
                  f"{c['read_MBps']:.0f}" for s, c in zip(rows["single"], rows["cluster"])) + ".", "",
              "Loopback, one process; the machine was shared (2 cores, other jobs running): the repeats "
              "scatter by 2x, so read the medians as 'about the same', not as a ranking.", ""]
    (args.out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
