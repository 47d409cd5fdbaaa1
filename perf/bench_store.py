"""Module store benchmarks.

``policy``: GreedyDual-Size-Frequency vs plain LRU on a skewed workload. ``--blocks`` blocks
with sizes log-uniform in 16..1024 tokens (``--bytes-per-token``), requested with Zipf(``--zipf``)
popularity independent of size, through a real ``TieredStore`` on CPU: device budget
``--device-frac`` and host budget ``--host-frac`` of all bytes, a disk tier (temporary directory)
holding everything. Reported per policy: hits per tier, disk loads, time spent in ``get``, and the modelled refill time (each tier's ``REFILL_COST`` for each miss at that tier).
Then the same without a disk tier, where a miss means re-encoding (modelled with the disk tier's
cost: 20 ms + size / 50 MB/s).

``modules``: encode vs load time per module of the shipped demo schema on the embedded model
(SmolLM2-135M): each unit encoded alone (ancestors in memory), then loaded back from disk as a
restarted process would (read + sha256 verify), and the whole restart (new ``PromptCache`` over
the directory, ``add_schema``, first prompt) vs encoding from scratch.

    python perf/bench_store.py policy [--blocks 200] [--requests 4000] [--zipf 1.0]
    python perf/bench_store.py modules [--model smollm2]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from importlib import resources

import torch

from pckernels.store import BlockKey, TieredStore
from pckernels.store.tiered import REFILL_COST


def zipf_sampler(n: int, s: float, rng: random.Random):
    weights = [1.0 / (rank + 1) ** s for rank in range(n)]
    total = sum(weights)
    cumulative, acc = [], 0.0
    for w in weights:
        acc += w / total
        cumulative.append(acc)
    order = list(range(n))
    rng.shuffle(order)
    return lambda: order[min(_bisect(cumulative, rng.random()), n - 1)]


def _bisect(values: list[float], x: float) -> int:
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def run_policy(policy: str, sizes: list[int], requests: list[int], *, device_budget: int, host_budget: int,
               with_disk: bool, bytes_per_token: int) -> dict:
    keys = [BlockKey(f"{i:064x}", module=f"m{i}", tokens=n) for i, n in enumerate(sizes)]
    width = bytes_per_token // 4

    def make(i: int) -> torch.Tensor:
        return torch.full((1, 1, 1, sizes[i], width), float(i))

    with tempfile.TemporaryDirectory() as tmp:
        store = TieredStore("cpu", device_budget=device_budget, host_budget=host_budget, policy=policy,
                            disk_dir=tmp if with_disk else None, disk_budget=10 * sum(sizes) * bytes_per_token)
        for i in range(len(sizes)):
            store.put(keys[i], make(i))
        before = store.stats()
        modelled = wall = 0.0
        for i in requests:
            size = sizes[i] * bytes_per_token
            device_hits, host_hits = store.device_tier.hits, store.host_tier.hits
            t0 = time.perf_counter()
            block = store.get(keys[i])
            wall += time.perf_counter() - t0
            if block is None:
                modelled += REFILL_COST["disk"](size)
                store.put(keys[i], make(i))
            elif store.device_tier.hits == device_hits:
                modelled += REFILL_COST["device-cpu"](size)
                if store.host_tier.hits == host_hits:
                    modelled += REFILL_COST["host"](size)
        stats = store.stats()
    n = len(requests)
    out = {"policy": policy, "device_hit": (stats["device"]["hits"] - before["device"]["hits"]) / n,
           "host_hit": (stats["host"]["hits"] - before["host"]["hits"]) / n, "wall_s": wall,
           "modelled_s": modelled}
    if with_disk:
        out.update(disk_loads=stats["disk"]["loads"], disk_load_s=stats["disk"]["load_s"])
    else:
        out.update(misses=stats["misses"])
    return out


def bench_policy(args) -> list[dict]:
    rng = random.Random(args.seed)
    sizes = [int(math.exp(rng.uniform(math.log(16), math.log(1024)))) for _ in range(args.blocks)]
    draw = zipf_sampler(args.blocks, args.zipf, rng)
    requests = [draw() for _ in range(args.requests)]
    total = sum(sizes) * args.bytes_per_token
    budgets = dict(device_budget=int(total * args.device_frac), host_budget=int(total * args.host_frac),
                   bytes_per_token=args.bytes_per_token)
    print(f"{args.blocks} blocks, {total / 2**20:.0f} MiB in all; device {args.device_frac:.0%}, host "
          f"{args.host_frac:.0%}; {args.requests} requests, Zipf s={args.zipf}")
    rows = []
    for with_disk in (True, False):
        for policy in ("lru", "gds"):
            row = run_policy(policy, sizes, requests, with_disk=with_disk, **budgets)
            row["disk"] = with_disk
            rows.append(row)
            extra = (f"disk loads {row['disk_loads']:5d} ({row['disk_load_s']:.2f} s)" if with_disk
                     else f"re-encodes {row['misses']:5d}")
            print(f"  {'with disk' if with_disk else 'no disk  '} {policy:3s}: device hit {row['device_hit']:.1%}, "
                  f"host hit {row['host_hit']:.1%}, {extra}, gets {row['wall_s']:.2f} s, "
                  f"modelled refill {row['modelled_s']:.2f} s")
    return rows


def bench_modules(args) -> dict:
    from pckernels.engine import PromptCache

    demo = resources.files("pckernels") / "data" / "demo"
    prompts = json.loads((demo / "prompts.json").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp, resources.as_file(demo / "city_guide.xml") as schema_path:
        t0 = time.perf_counter()
        first = PromptCache.from_pretrained(args.model, store_dir=tmp)
        model_load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        schema = first.add_schema(schema_path)
        encode_all_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        want = first.generate(prompts[0]["prompt"], max_new_tokens=8)
        first_prompt_warm_s = time.perf_counter() - t0
        units = [("", (m,)) for m in schema.modules] + [(s.name, s.members) for s in schema.scaffolds.values()]
        per_module = []
        for scaffold, members in units:
            encode_s = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                with torch.inference_mode(), first.model_lock:
                    first.encoder.encode_unit(schema, scaffold, members)
                encode_s.append(time.perf_counter() - t0)
            for member in members:
                key = first.block_key(schema, member, scaffold)
                load_s = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    block = first.store.disk.read(key)
                    load_s.append(time.perf_counter() - t0)
                per_module.append({"module": key.label, "tokens": key.tokens,
                                   "mib": block.numel() * block.element_size() / 2**20,
                                   "encode_ms": statistics.median(encode_s) * 1e3 / len(members),
                                   "load_ms": statistics.median(load_s) * 1e3})
        restarted = PromptCache(first.model, first.tokenizer, name=first.name, store_dir=tmp)
        t0 = time.perf_counter()
        restarted.add_schema(schema_path)
        got = restarted.generate(prompts[0]["prompt"], max_new_tokens=8)
        restart_s = time.perf_counter() - t0
        assert got.token_ids == want.token_ids and torch.equal(got.first_logits, want.first_logits)
        assert restarted.stats()["encodes"] == 0
        scratch = PromptCache(first.model, first.tokenizer, name=first.name)
        t0 = time.perf_counter()
        scratch.add_schema(schema_path)
        scratch.generate(prompts[0]["prompt"], max_new_tokens=8)
        scratch_s = time.perf_counter() - t0
    print(f"{args.model}: model load {model_load_s:.1f} s; add_schema with write-through {encode_all_s:.2f} s")
    print(f"{'module':40s} {'tokens':>6s} {'MiB':>6s} {'encode ms':>10s} {'load ms':>8s} {'ratio':>6s}")
    for row in per_module:
        print(f"{row['module']:40s} {row['tokens']:6d} {row['mib']:6.2f} {row['encode_ms']:10.1f} "
              f"{row['load_ms']:8.1f} {row['encode_ms'] / max(row['load_ms'], 1e-6):6.1f}x")
    total_encode = sum(r["encode_ms"] for r in per_module)
    total_load = sum(r["load_ms"] for r in per_module)
    print(f"{'all':40s} {sum(r['tokens'] for r in per_module):6d} {sum(r['mib'] for r in per_module):6.2f} "
          f"{total_encode:10.1f} {total_load:8.1f} {total_encode / total_load:6.1f}x")
    print(f"restart (add_schema + first prompt, loads from disk): {restart_s:.2f} s; "
          f"from scratch (encode + first prompt): {scratch_s:.2f} s; outputs identical")
    return {"per_module": per_module, "restart_s": restart_s, "scratch_s": scratch_s,
            "encode_all_write_through_s": encode_all_s, "first_prompt_s": first_prompt_warm_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["policy", "modules"])
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--bytes-per-token", type=int, default=2048)
    parser.add_argument("--device-frac", type=float, default=0.05)
    parser.add_argument("--host-frac", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="Write the results to this file.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = bench_policy(args) if args.part == "policy" else bench_modules(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
