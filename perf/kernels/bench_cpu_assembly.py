"""CPU: assemble 4K tokens of the embedded model's KV through the torch path vs one torch copy.

SmolLM2-135M KV: L=30 layers, H=3 KV heads, D=64, fp32 -> 30*2*3*64*4 = 46,080 B per token,
4,096 tokens = 188,743,680 B. The assembly copies ``--modules`` cached blocks into a buffer
with spare capacity (so its destination rows are strided, as in the engine) through
``pckernels.ops.gather_concat(backend="torch")``, and through the registered op; the baseline
is one contiguous ``dst.copy_(src)`` of the same bytes. Runs interleaved, median and spread.

    .venv/bin/python perf/kernels/bench_cpu_assembly.py [--repeats 15] [--modules 8] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pckernels import ops

L, H, D = 30, 3, 64


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--modules", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.tokens // args.modules
    tokens = n * args.modules
    nbytes = L * 2 * H * tokens * D * 4
    blocks = [torch.randn(L, 2, H, n, D) for _ in range(args.modules)]
    cap = tokens + 512
    out = torch.full((L, 2, H, cap, D), float("nan"))
    table = torch.tensor([[i, 0, 1 + i * n, n] for i in range(args.modules)], dtype=torch.int32)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)

    cases = {
        "one torch copy (contiguous)": lambda: dst.copy_(src),
        "gather_concat torch path": lambda: ops.gather_concat(out, blocks, table, backend="torch"),
        "torch.ops.promptcache.gather_concat": lambda: torch.ops.promptcache.gather_concat(out, blocks, table, -1,
                                                                                           "torch"),
        "torch.cat (allocates)": lambda: torch.cat(blocks, dim=3),
    }
    for fn in cases.values():
        fn()
    times = {k: [] for k in cases}
    for _ in range(args.repeats):
        for k, fn in cases.items():
            times[k].append(timed(fn))
    expect = torch.cat(blocks, dim=3)
    assert torch.equal(out[:, :, :, 1:1 + tokens], expect)

    base = statistics.median(times["one torch copy (contiguous)"])
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, L={L} H={H} D={D} fp32, "
          f"{tokens} tokens in {args.modules} blocks, {nbytes:,} B ({nbytes / 1e6:.1f} MB), repeats={args.repeats}")
    print(f"{'case':40s} {'median ms':>10s} {'min':>8s} {'max':>8s} {'IQR':>7s} {'GB/s':>7s} {'vs copy':>8s}")
    for k, ts in times.items():
        med = statistics.median(ts)
        q = statistics.quantiles(ts, n=4)
        print(f"{k:40s} {med * 1e3:10.2f} {min(ts) * 1e3:8.2f} {max(ts) * 1e3:8.2f} {(q[2] - q[0]) * 1e3:7.2f} "
              f"{nbytes / med / 1e9:7.2f} {med / base:7.2f}x")


if __name__ == "__main__":
    main()
