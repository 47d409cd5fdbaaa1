"""Attention for a few new tokens over many rows: dense-bias SDPA vs FlexAttention vs split-KV.

    python -m perf.bench_attention --gpu        # CUDA, bf16, Llama-2-7B heads (32 q heads, 32 or 8 KV
                                               # heads, D 128): 1/4/16 new tokens over 1K/4K/8K/32K rows
    python -m perf.bench_attention              # CPU, fp32: the same at 1/4 tokens over 1K/4K rows,
                                               # with the CPU paths (native's per-KV-head matmuls, a
                                               # plain-torch split-KV) instead of the Triton kernel
    python -m perf.bench_attention --tiny       # the plumbing on tiny shapes (the test runs this)

One layer's attention, as a step runs it: one request's ``n`` new tokens at the end of ``rows``
rows it may all see (its mask by rows: one group; the dense path's additive bias ``[n, rows]``).
Variants: ``dense`` — SDPA with the additive bias after HF's ``repeat_kv`` (what the HF forward
runs on CUDA today: ``integration/attention.py`` hands a masked CUDA call to HF's ``"sdpa"``);
``dense_gqa`` — the same with ``enable_gqa`` (no copies); ``flex`` — FlexAttention (compiled on
CUDA, its block mask built beforehand: a forward builds it once for all layers, timed apart as
``flex_mask``); ``split_kv`` — :func:`pckernels.ops.row_attention` (Triton on CUDA; on the CPU its
torch path); on the CPU also ``native`` (the native forward's per-KV-head matmuls) and
``split_torch`` (split-KV in plain torch: rows in 1,024-row pieces, partial softmaxes combined).
Times are medians (and bests) of ``--repeats`` rounds, variants interleaved within a round (a
round's time: CUDA events over 10 calls on the GPU, the best of 3 calls on the CPU); bandwidth is the K and V bytes one call must read over its time. Each variant's output is
compared with ``dense`` (max-abs). ``--seen 0.4``: the request sees 40% of the rows (256-row
blocks), as in a batched step whose requests import different modules: the dense path still reads
every row, the split-KV kernel only those some query sees. One JSON object on the last line; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pckernels import ops
from pckernels.integration.attention import sdpa
from pckernels.integration.row_attention import RowMask, attend_rows, flex_block_mask

GPU_GRID = dict(tokens=[1, 4, 16], rows=[1024, 4096, 8192, 32768], kv_heads=[32, 8])
CPU_GRID = dict(tokens=[1, 4], rows=[1024, 4096], kv_heads=[8])
TINY_GRID = dict(tokens=[1, 3], rows=[40], kv_heads=[2])
Q_HEADS, HEAD_DIM = 32, 128
SPLIT_ROWS = 1024


def inputs(n: int, rows: int, q_heads: int, kv_heads: int, d: int, dtype, device, seen: float = 1.0) -> dict:
    """HF-shaped q ``[1, Hq, n, D]``, k/v ``[1, Hkv, rows, D]``, the dense bias and the mask by rows;
    ``seen < 1``: the request sees that share of the rows, in 256-row blocks (the rest are other
    requests' modules in a batched step), its last block always."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, q_heads, n, d, generator=g).to(device, dtype)
    k = torch.randn(1, kv_heads, rows, d, generator=g).to(device, dtype)
    v = torch.randn(1, kv_heads, rows, d, generator=g).to(device, dtype)
    key_pos = torch.arange(rows, device=device)
    query_pos = torch.arange(rows - n, rows, device=device)
    visible = torch.ones(rows, dtype=torch.bool)
    if seen < 1.0:
        blocks = torch.rand(-(-rows // 256), generator=g) < seen
        blocks[-1] = True
        visible = blocks.repeat_interleave(256)[:rows]
    visible = visible.to(device)
    allowed = (key_pos[None, :] <= query_pos[:, None]) & visible[None, :]
    bias = torch.zeros(n, rows, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))[None, None]
    mask = RowMask(visible[None].clone(), torch.zeros(n, dtype=torch.int32, device=device),
                   query_pos, key_pos, torch.zeros(n, dtype=torch.int32, device=device),
                   torch.full((n,), rows, dtype=torch.int32, device=device))
    return dict(q=q, k=k, v=v, bias=bias, rows=mask, scale=d ** -0.5)


def split_torch(q, k, v, bias, scale, piece: int = SPLIT_ROWS):
    """Split-KV in plain torch: per KV head, the group's query rows over ``piece`` rows at a time,
    partial softmaxes combined by their maxima -> ``[1, n, Hq, D]``."""
    _, hq, n, d = q.shape
    hkv, rows = k.shape[1], k.shape[2]
    qg = (q[0] * scale).reshape(hkv, hq // hkv * n, d)
    b = bias[0, 0]
    tops, sums, outs = [], [], []
    for first in range(0, rows, piece):
        s = torch.baddbmm(b[None, :, first:first + piece].repeat(1, hq // hkv, 1), qg,
                          k[0, :, first:first + piece].transpose(1, 2))
        top = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - top)
        tops.append(top)
        sums.append(p.sum(dim=-1, keepdim=True))
        outs.append(torch.bmm(p, v[0, :, first:first + piece]))
    top = torch.stack(tops).amax(dim=0)
    w = [torch.exp(t - top) for t in tops]
    out = sum(o * wi for o, wi in zip(outs, w)) / sum(s * wi for s, wi in zip(sums, w))
    return out.view(hq, n, d).transpose(0, 1)[None]


def native(q, k, v, bias, scale):
    """The native CPU forward's attention for a few rows: per KV head, its query heads' rows in one
    matmul, the mask added in place (``integration/native.py: NativeDecoder._attend_head``)."""
    from pckernels.integration.native import NativeDecoder

    _, hq, n, d = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    qg = (q[0] * scale).reshape(hkv, groups * n, d)
    out = torch.stack([NativeDecoder._attend_head(qg[h], k[0, h], v[0, h], bias[0, 0], groups, n)
                       for h in range(hkv)])
    return out.view(hq, n, d).transpose(0, 1)[None]


def variants(x: dict, gpu: bool) -> dict:
    q, k, v, bias, rows, scale = x["q"], x["k"], x["v"], x["bias"], x["rows"], x["scale"]
    memo: dict = {}
    memo[("flex", (k.shape[2],))] = flex_block_mask(rows, q.shape[2], k.shape[2], q.device)
    out = {
        "dense": lambda: sdpa(q, k, v, bias, scale, False),
        "dense_gqa": lambda: sdpa(q, k, v, bias, scale, True),
        "flex": lambda: attend_rows("flex", q, k, v, rows, scale, memo),
        "flex_mask": lambda: flex_block_mask(rows, q.shape[2], k.shape[2], q.device),
        "split_kv": lambda: ops.row_attention(q[0], k[0], v[0], rows.seen, rows.group, rows.query_pos, rows.key_pos,
                                              rows.start, rows.stop, scale=scale)[None],
    }
    if not gpu:
        out["native"] = lambda: native(q, k, v, bias, scale)
        out["split_torch"] = lambda: split_torch(q, k, v, bias, scale)
    return out


def timed(fn, gpu: bool, inner: int = 3) -> float:
    """Seconds per call: CUDA events over 10 calls on the GPU, the best of ``inner`` calls on the
    CPU (a shared CPU preempts single calls)."""
    if gpu:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 10 / 1000
    best = float("inf")
    for _ in range(inner):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure(n: int, rows: int, kv_heads: int, *, q_heads: int, d: int, dtype, device, repeats: int,
            only: list[str] | None = None, seen: float = 1.0) -> list[dict]:
    gpu = device.type == "cuda"
    x = inputs(n, rows, q_heads, kv_heads, d, dtype, device, seen)
    runs = variants(x, gpu)
    runs = {name: fn for name, fn in runs.items() if name == "dense" or not only or name in only}
    want = runs["dense"]().float()
    diffs, times = {}, {name: [] for name in runs}
    for name, fn in runs.items():  # warm-up (compiles flex and the kernel) and the check
        got = fn()
        if name != "flex_mask":
            diffs[name] = (got.float() - want).abs().max().item()
    if gpu:
        torch.cuda.synchronize()
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn, gpu))
    kv_bytes = 2 * kv_heads * rows * d * x["k"].element_size()
    return [dict(tokens=n, rows=rows, kv_heads=kv_heads, seen=seen, variant=name, ms=1e3 * statistics.median(t),
                 best_ms=1e3 * min(t),
                 gbps=None if name == "flex_mask" else kv_bytes / statistics.median(t) / 1e9,
                 max_abs_vs_dense=diffs.get(name)) for name, t in times.items()]


def table(rows: list[dict]) -> str:
    lines = ["| new tokens | rows | KV heads | variant | median ms | best ms | GB/s (K+V, median) | max-abs vs dense |",
             "|" + "---|" * 8]
    for r in rows:
        gbps = "" if r["gbps"] is None else f"{r['gbps']:.1f}"
        diff = "" if r["max_abs_vs_dense"] is None else f"{r['max_abs_vs_dense']:.2g}"
        lines.append(f"| {r['tokens']} | {r['rows']} | {r['kv_heads']} | {r['variant']} | {r['ms']:.3f} | "
                     f"{r['best_ms']:.3f} | {gbps} | {diff} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA, bf16, the full grid")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, CPU (the plumbing)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--variants", nargs="+", help="only these (and dense, the yardstick)")
    ap.add_argument("--tokens", type=int, nargs="+", help="override the grid's new tokens")
    ap.add_argument("--rows", type=int, nargs="+", help="override the grid's rows")
    ap.add_argument("--heads", type=int, nargs=2, metavar=("Q", "KV"), help="query and KV heads (one KV count)")
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--threads", type=int, help="torch threads (CPU)")
    ap.add_argument("--seen", type=float, default=1.0,
                    help="share of the rows the request sees (256-row blocks; default all); bandwidth stays "
                         "that of all rows, what the dense path reads")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        print("no CUDA device (run without --gpu for the CPU variants)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.gpu:  # one compiled FlexAttention per shape until dynamo turns dynamic: allow them all
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    dtype = torch.bfloat16 if args.gpu else torch.float32
    grid = dict(GPU_GRID if args.gpu else TINY_GRID if args.tiny else CPU_GRID)
    grid.update({k: v for k, v in (("tokens", args.tokens), ("rows", args.rows)) if v})
    q_heads, d = (4, 16) if args.tiny else (Q_HEADS, HEAD_DIM)
    if args.heads:
        q_heads, grid["kv_heads"] = args.heads[0], [args.heads[1]]
    d = args.head_dim or d
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.tiny else 7 if not args.gpu else 20)
    results = []
    for kv_heads in grid["kv_heads"]:
        for rows in grid["rows"]:
            for n in grid["tokens"]:
                results += measure(n, rows, kv_heads, q_heads=q_heads, d=d, dtype=dtype, device=device,
                                   repeats=repeats, only=args.variants, seen=args.seen)
                done = [r for r in results if (r["tokens"], r["rows"], r["kv_heads"]) == (n, rows, kv_heads)]
                print(f"{n} tokens over {rows} rows, {kv_heads} KV heads: "
                      + ", ".join(f"{r['variant']} {r['ms']:.3f} ms" for r in done), flush=True)
    report = dict(device=torch.cuda.get_device_name() if args.gpu else "cpu", dtype=str(dtype), q_heads=q_heads,
                  head_dim=d, repeats=repeats, torch=torch.__version__, threads=torch.get_num_threads(),
                  results=results)
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
