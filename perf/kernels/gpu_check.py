"""Lane 3 in one script: on a GPU machine run the kernel tests (compiled), then time every
kernel with ``triton.testing.do_bench`` against torch native (``cat`` / per-block copies,
``index_copy_``, HF RoPE) and a plain device-to-device copy of the same bytes; GB/s counts
bytes read + written. GPU name, memory and clocks come from nvidia-ml-py when installed.

    .venv/bin/python perf/kernels/gpu_check.py                 # tests + benchmarks (CUDA)
    .venv/bin/python perf/kernels/gpu_check.py --skip-tests
    .venv/bin/python perf/kernels/gpu_check.py --dry-run       # CPU: tiny shapes, interpreter, no tests

Targets (issue 4): gather >= 80% of the copy bandwidth for >= 256 MB, RoPE >= 70%; (issue 21)
gather-rotate >= 70%; (issue 41) gather-concat and gather-rotate >= 80%. The gathers' lines say
which variant (aligned or generic, ``docs/kernels.md``) their launches took.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke run of everything but the tests")
    ap.add_argument("--gather-mb", type=float, default=512.0, help="bytes assembled by gather (fp16)")
    return ap.parse_args()


ARGS = parse()
if ARGS.dry_run:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from pckernels import extras, ops  # noqa: E402
from pckernels.kernels import triton_runnable  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() and not ARGS.dry_run else "cpu")


def gpu_info() -> None:
    print(f"torch {torch.__version__}", end="")
    try:
        import triton

        print(f", triton {triton.__version__}", end="")
    except ImportError:
        pass
    print(f", device {DEV}")
    if DEV.type != "cuda":
        return
    p = torch.cuda.get_device_properties(DEV)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
    try:
        import pynvml
    except ImportError:
        print("nvidia-ml-py not installed: no clocks")
        return
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        clk = {n: (pynvml.nvmlDeviceGetClockInfo(h, c), pynvml.nvmlDeviceGetMaxClockInfo(h, c))
               for n, c in (("sm", pynvml.NVML_CLOCK_SM), ("mem", pynvml.NVML_CLOCK_MEM))}
        print(f"NVML: driver {pynvml.nvmlSystemGetDriverVersion()}, memory used {mem.used / 2**30:.1f} / "
              f"{mem.total / 2**30:.1f} GiB, clocks (now/max MHz) sm {clk['sm'][0]}/{clk['sm'][1]}, "
              f"mem {clk['mem'][0]}/{clk['mem'][1]}, power {pynvml.nvmlDeviceGetPowerUsage(h) / 1000:.0f} W")
        pynvml.nvmlShutdown()
    except Exception as exc:  # NVML is informational only
        print(f"NVML query failed: {exc}")


def run_tests() -> int:
    row = "tests/test_row_attention.py::"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels_triton.py",
           "tests/test_ops.py", "tests/test_rope_patch.py", row + "test_split_kv_kernel_matches_reference",
           row + "test_split_kv_kernel_matches_dense_sdpa", row + "test_split_kv_kernel_takes_strided_views",
           row + "test_backends_in_captured_steps_on_cuda"]
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def bench_ms(fn) -> float:
    """Median ms: ``triton.testing.do_bench`` on CUDA, a perf_counter loop otherwise."""
    if DEV.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def report(title: str, moved_bytes: int, cases: dict, copy_key: str = "d2d copy (same bytes)") -> dict:
    """Time each case; print ms, GB/s (read + write) and % of the copy's bandwidth."""
    res = {k: bench_ms(fn) for k, fn in cases.items()}
    print(f"\n{title}: {moved_bytes / 2 / 1e6:.1f} MB copied ({moved_bytes / 1e6:.1f} MB read + written)")
    for k, ms in res.items():
        gbs = moved_bytes / (ms * 1e-3) / 1e9
        pct = res[copy_key] / ms * 100 if copy_key in res else float("nan")
        print(f"  {k:40s} {ms * 1e3:10.1f} us {gbs:9.1f} GB/s {pct:6.1f}% of copy")
    return res


def triton_ok() -> bool:
    return triton_runnable(DEV)


def variant(out: torch.Tensor, blocks: list[torch.Tensor]) -> str:
    """Which gather variant a launch over these tensors takes (``kernels/_align.py``)."""
    from pckernels.kernels._align import all_rows_aligned, layout_of

    return "aligned" if all_rows_aligned([layout_of(t) for t in (out, *blocks)], flat_rows=True) else "generic"


def block_workload(dt: torch.dtype, delta=None):
    """Eight KV blocks ``[L, 2, H, n, D]`` of ``dt`` (``--gather-mb`` in all on CUDA, tiny on CPU),
    an ``out`` buffer with room for them, the host table placing them end to end (``delta(i)`` as
    a fifth column when given) and a copy source/destination of the same bytes."""
    L, H, D = (32, 8, 128) if DEV.type == "cuda" else (2, 1, 8)
    per_token = L * 2 * H * D * 2
    tokens = max(8, int(ARGS.gather_mb * 1e6 // per_token)) if DEV.type == "cuda" else 24
    nblk = 8
    n = tokens // nblk
    tokens = n * nblk
    blocks = [torch.randn(L, 2, H, n, D, device=DEV, dtype=dt) for _ in range(nblk)]
    out = torch.empty(L, 2, H, tokens + 256, D, device=DEV, dtype=dt)
    rows = [[i, 0, i * n, n] + ([delta(i)] if delta else []) for i in range(nblk)]
    table_host = torch.tensor(rows, dtype=torch.int64 if delta else torch.int32)
    nbytes = L * 2 * H * tokens * D * 2
    src = torch.empty(nbytes // 2, device=DEV, dtype=dt)
    return SimpleNamespace(L=L, H=H, D=D, n=n, nblk=nblk, tokens=tokens, blocks=blocks, out=out,
                           table_host=table_host, nbytes=nbytes, src=src, dst=torch.empty_like(src))


def bench_gather() -> None:
    w = block_workload(torch.float16)
    n, tokens, blocks, out, table_host, nbytes = w.n, w.tokens, w.blocks, w.out, w.table_host, w.nbytes
    table = table_host.to(DEV)
    src, dst = w.src, w.dst
    cases = {"d2d copy (same bytes)": lambda: dst.copy_(src),
             "torch.cat (allocates)": lambda: torch.cat(blocks, dim=3),
             "gather torch path (copy_ per block)": lambda: ops.gather_concat(out, blocks, table_host, backend="torch")}
    if triton_ok():
        cases["gather triton (device table)"] = lambda: ops.gather_concat(out, blocks, table, max_rows=n,
                                                                          backend="triton")
        cases["torch.ops.promptcache.gather_concat"] = lambda: torch.ops.promptcache.gather_concat(
            out, blocks, table, n, "triton")
        ops.gather_concat(out, blocks, table, max_rows=n, backend="triton")
        assert torch.equal(out[:, :, :, :tokens], torch.cat(blocks, dim=3)), "gather mismatch"
    report(f"gather-concat L={w.L} H={w.H} D={w.D} fp16, {tokens} tokens in {w.nblk} blocks", 2 * nbytes, cases)
    print(f"  Triton variant: {variant(out, blocks)}")


def bench_scatter() -> None:
    B, H, cap, D, dt = (1, 8, 16384, 128, torch.float16) if DEV.type == "cuda" else (1, 2, 16, 8, torch.float16)
    k_out = torch.zeros(B, H, cap, D, device=DEV, dtype=dt)
    v_out = torch.zeros_like(k_out)
    for q in ((1, 512) if DEV.type == "cuda" else (1, 5)):
        k = torch.randn(B, H, q, D, device=DEV, dtype=dt)
        v = torch.randn_like(k)
        rows = torch.randperm(cap, device=DEV)[:q]
        rows32 = rows.int()
        nbytes = 2 * k.numel() * k.element_size()
        src = torch.empty(nbytes // 2, device=DEV, dtype=dt)
        dst = torch.empty_like(src)
        cases = {"d2d copy (same bytes)": lambda: dst.copy_(src),
                 "2x index_copy_": lambda: (k_out.index_copy_(2, rows, k), v_out.index_copy_(2, rows, v)),
                 "scatter torch path": lambda: ops.scatter_rows(k_out, v_out, k, v, rows32, backend="torch")}
        if triton_ok():
            cases["scatter triton (direct)"] = lambda: ops.scatter_rows(k_out, v_out, k, v, rows32, backend="triton")
            cases["torch.ops.promptcache.scatter_rows"] = lambda: torch.ops.promptcache.scatter_rows(
                k_out, v_out, k, v, rows32, "triton")
        report(f"slot scatter B={B} H={H} cap={cap} D={D} q={q} fp16", 2 * nbytes, cases)


def bench_rope() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    B, Hq, Hk, S, D, dt = (1, 32, 8, 8192, 128, torch.bfloat16) if DEV.type == "cuda" else (1, 2, 1, 6, 8,
                                                                                            torch.bfloat16)
    q = torch.randn(B, S, Hq, D, device=DEV, dtype=dt).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device=DEV, dtype=dt).transpose(1, 2)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    pos = torch.arange(S, device=DEV) * 3 + 7
    ang = pos[None, :, None].float() * inv
    cos = torch.cat((ang, ang), -1).cos().to(dt)
    sin = torch.cat((ang, ang), -1).sin().to(dt)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    src = torch.empty(nbytes // 4, device=DEV, dtype=dt)
    dst = torch.empty_like(src)
    cases = {"d2d copy (same bytes)": lambda: dst.copy_(src),
             "HF apply_rotary_pos_emb": lambda: hf_apply(q, k, cos, sin),
             "fused torch path": lambda: extras.apply_rotary_pos_emb(q, k, cos, sin, backend="torch")}
    qo = torch.empty_like(q)
    if triton_ok():
        cases["fused triton apply_rotary_pos_emb"] = lambda: extras.apply_rotary_pos_emb(q, k, cos, sin,
                                                                                         backend="triton")
        cases["triton rope_at_positions (q, into out)"] = lambda: extras.rope_at_positions(q, pos, inv, out=qo,
                                                                                            backend="triton")
        a = extras.apply_rotary_pos_emb(q, k, cos, sin, backend="triton")
        b = hf_apply(q, k, cos, sin)
        print(f"\nRoPE fused vs HF max abs diff (bf16): q {(a[0] - b[0]).abs().max().item():.3e}, "
              f"k {(a[1] - b[1]).abs().max().item():.3e}")
    report(f"RoPE q [{B},{Hq},{S},{D}] + k [{B},{Hk},{S},{D}] bf16 (q/k rows of a [B,S,H,D] projection)",
           nbytes, cases)
    keys = torch.randn(32 if DEV.type == "cuda" else 2, 2, Hk, S, D, device=DEV, dtype=dt)
    kb = 2 * keys[:, 0].numel() * keys.element_size()
    src2 = torch.empty(kb // 4, device=DEV, dtype=dt)
    dst2 = torch.empty_like(src2)
    cases = {"d2d copy (same bytes)": lambda: dst2.copy_(src2),
             "rerotate torch path": lambda: extras.rerotate_block(keys, 5, inv, backend="torch")}
    if triton_ok():
        cases["rerotate triton (in place)"] = lambda: extras.rerotate_block(keys, 5, inv, backend="triton")
    report(f"re-rotate keys of a KV block {tuple(keys.shape)} bf16", kb, cases)


def bench_gather_rotate() -> None:
    """Compact placement's block copy: gather-concat that re-rotates keys by a per-range delta."""
    w = block_workload(torch.bfloat16, delta=lambda i: 1000 * i - 3000)
    L, D, n, nblk, tokens = w.L, w.D, w.n, w.nblk, w.tokens
    blocks, out, table_host, nbytes, src, dst = w.blocks, w.out, w.table_host, w.nbytes, w.src, w.dst
    table = table_host.to(DEV)
    inv = (1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D)))[None].repeat(L, 1)
    cases = {"d2d copy (same bytes)": lambda: dst.copy_(src),
             "gather-rotate torch path": lambda: ops.gather_rotate(out, blocks, table_host, inv, backend="torch"),
             "gather-concat then rerotate (torch)": lambda: (
                 ops.gather_concat(out, blocks, table_host[:, :4], backend="torch"),
                 [extras.rerotate_keys(out[:, 0, :, i * n:(i + 1) * n], 1000 * i - 3000, inv[0], backend="torch")
                  for i in range(nblk)])}
    if triton_ok():
        cases["gather-rotate triton (device table)"] = lambda: ops.gather_rotate(out, blocks, table, inv, max_rows=n,
                                                                                 backend="triton")
        cases["gather-concat triton (no rotation)"] = lambda: ops.gather_concat(out, blocks, table[:, :4].contiguous(),
                                                                                max_rows=n, backend="triton")
        ops.gather_rotate(out, blocks, table, inv, max_rows=n, backend="triton")
        want = torch.empty_like(out)
        ops.gather_rotate(want, blocks, table_host, inv, backend="torch")
        err = (out[:, :, :, :tokens].float() - want[:, :, :, :tokens].float()).abs().max().item()
        print(f"\ngather-rotate triton vs torch path max abs diff (bf16): {err:.3e}")
    res = report(f"gather-rotate L={L} H={w.H} D={D} bf16, {tokens} tokens in {nblk} moved blocks", 2 * nbytes,
                 cases)
    print(f"  Triton variant: {variant(out, blocks)}")
    key = "gather-rotate triton (device table)"
    if key in res:
        share = res["d2d copy (same bytes)"] / res[key]
        print(f"  target >= 70% of copy bandwidth: {'met' if share >= 0.7 else 'NOT met'} ({share * 100:.0f}%)")


def main() -> int:
    gpu_info()
    rc = 0
    if not ARGS.skip_tests and not ARGS.dry_run:
        rc = run_tests()
        print(f"tests exit code {rc}")
    with torch.inference_mode():
        bench_gather()
        bench_scatter()
        bench_rope()
        bench_gather_rotate()
    print("\nlaunch counts:", ops.launch_counts())
    return rc


if __name__ == "__main__":
    sys.exit(main())
