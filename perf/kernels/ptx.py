"""Offline PTX of the product kernels: compile each for sm_90 without a GPU and count its global
loads and stores by width.

    python -m perf.kernels.ptx            # a table per kernel
    python -m perf.kernels.ptx --json     # ... and one JSON object on the last line
    python -m perf.kernels.ptx --asm gather_concat --stage ptx    # print one kernel's PTX (or ttgir)

Each kernel is compiled as the JIT would compile it for one representative launch (a random
Llama-2-7B-shaped cache in bf16: L=32, H=32, D=128; gathers of 640-row blocks into an 8,192-row
arena; a 20-token scatter, and a decode step's one-row scatter as ``..._q1``): the same
constexprs and warps as the launcher picks, and the JIT's
specialisation of the other arguments (integers equal to 1 become constants, pointers and
integers divisible by 16 carry ``tt.divisibility``). The aligned variants appear under the op's
name (``gather_concat``, ``gather_rotate``, ``scatter_rows``), the generic ones with
``_generic``. ``ld.global.v4.b32`` is a 16-byte vector load, ``ld.global.b16`` a 2-byte scalar;
``convert_layout`` says whether the Triton GPU IR moves a tensor between layouts (through shared
memory) before a store. Counts are per thread and per program, from the PTX text (static
instruction count, not executions). The table also gives registers and spills from Triton's
bundled ``ptxas -v`` where it runs (not in the JSON).

``TRITON_INTERPRET`` is cleared here: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402

ARCH = 90
WARP = 32
L, H, D, HALF = 32, 32, 128, 64
CAP, BLOCK_ROWS, Q = 8192, 640, 20
DTYPE = torch.bfloat16

_ACCESS = re.compile(r"\b((?:ld|st)\.global(?:\.[\w:]+)*)")
_ASYNC = re.compile(r"\b(cp\.async\.\w+\.shared\.global) \[[^]]*\], \[[^]]*\], (0x\w+|\d+)")


def offline_compiler():
    """``(compile, ASTSource, GPUTarget, BaseBackend, specialize)`` of the installed Triton, or a
    string saying why it cannot compile without a GPU."""
    try:
        import triton
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend, GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        return f"this triton cannot compile offline ({exc})"
    return triton.compile, ASTSource, GPUTarget, BaseBackend, native_specialize_impl


def specialise(fn, args: dict, tools) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` for ``fn`` called with ``args`` (name -> value; tensors
    stand for pointers: only their dtype and address alignment count), as the JIT derives them."""
    _, _, _, backend, specialize = tools
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        value = args[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
            continue
        kind, attr = specialize(backend, value, False, True, True)[:2]
        if kind == "constexpr":
            signature[name] = "constexpr"
            constexprs[name] = attr
            continue
        signature[name] = kind
        if isinstance(attr, str) and attr:
            parsed = backend.parse_attr(attr)
            if parsed:
                attrs[(i,)] = parsed
    return signature, constexprs, attrs


def compile_kernel(fn, args: dict, tools, num_warps: int | tuple[int, int] = 4):
    """The compiled kernel (``.asm`` has ``ttgir``, ``ptx``, and ``cubin`` when ptxas ran);
    ``num_warps`` may be ``(warps, stages)``."""
    compile_, ast_source, gpu_target, _, _ = tools
    options = {"num_warps": num_warps}
    if isinstance(num_warps, tuple):
        options = {"num_warps": num_warps[0], "num_stages": num_warps[1]}
    signature, constexprs, attrs = specialise(fn, args, tools)
    src = ast_source(fn, signature, constexprs=constexprs, attrs=attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_(src, target=gpu_target("cuda", ARCH, WARP), options=options)


def summary(kernel) -> dict:
    """``{"loads": {...}, "stores": {...}, "convert_layout": bool}`` of a compiled kernel; global->shared
    async copies (how tiles feeding ``tl.dot`` are loaded on sm_90) count as loads, by bytes:
    ``cp.async.cg.shared.global.16B``."""
    found = Counter(_ACCESS.findall(kernel.asm["ptx"]))
    found.update(f"{op}.{int(size, 0)}B" for op, size in _ASYNC.findall(kernel.asm["ptx"]))
    loads = {k: v for k, v in sorted(found.items()) if k.startswith(("ld.", "cp."))}
    stores = {k: v for k, v in sorted(found.items()) if k.startswith("st.")}
    return {"loads": loads, "stores": stores, "convert_layout": "convert_layout" in kernel.asm["ttgir"]}


def ptxas_usage(kernel) -> str:
    """``"N registers, S bytes spilled"`` from Triton's bundled ``ptxas -v`` on the kernel's PTX,
    or why not (text output only)."""
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(kernel.asm["ptx"])
            log = subprocess.run([get_ptxas(ARCH).path, f"--gpu-name=sm_{ARCH}a", "-v", src, "-o", src + ".o"],
                                 capture_output=True, text=True, timeout=120).stderr
    except Exception as exc:  # informational only
        return f"ptxas unavailable ({type(exc).__name__})"
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    if not regs:
        return "ptxas gave no usage"
    return f"{regs.group(1)} registers, {spill.group(1) if spill else '?'} bytes spilled"


def ptr(dtype: torch.dtype, aligned: bool = True) -> torch.Tensor:
    """A stand-in pointer argument: a small host tensor, 16-byte aligned or 2 bytes off."""
    t = torch.zeros(64, dtype=dtype)
    return t if aligned else t.view(torch.uint8)[2:2 + 16 * t.element_size()].view(dtype)


def cases() -> dict:
    """Kernel name -> ``(jit function, args, num_warps)`` for the representative launches."""
    from pckernels.kernels.gather_concat import kernel as gc
    from pckernels.kernels.gather_rotate import kernel as gr
    from pckernels.kernels.scatter_rows import kernel as sr
    from pckernels.kernels._triton_common import PRECISE_TRIG

    bits = {2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=DTYPE).element_size()]
    vec = 16 // torch.empty(0, dtype=DTYPE).element_size()
    itemsize = torch.empty(0, dtype=DTYPE).element_size()
    meta = ptr(torch.int64)  # a host table travels behind the meta rows: 8 blocks, 54 values in
    out = {}
    for aligned, suffix in ((True, ""), (False, "_generic")):
        _, block, block_r, block_d, warps = gc.config(BLOCK_ROWS, D, itemsize, aligned)
        out["gather_concat" + suffix] = (gc._gather_concat_kernel, dict(
            out_ptr=ptr(bits), meta_ptr=meta, table_ptr=meta, table_at=6 * (1 + 8), H=H, D=D, ALIGNED=aligned, VEC=vec,
            BLOCK=block, BLOCK_R=block_r, BLOCK_D=block_d), warps)
        _, block_r, block_d, block_j, block_t, block_f, warps = gr.config(BLOCK_ROWS, D, HALF, aligned, itemsize)
        out["gather_rotate" + suffix] = (gr._gather_rotate_kernel, dict(
            out_ptr=ptr(DTYPE), bits_ptr=ptr(DTYPE), meta_ptr=meta, table_ptr=meta, table_at=6 * (1 + 8), inv_ptr=ptr(torch.float32),
            H=H, D=D, HALF=HALF, ALIGNED=aligned, VEC=vec, PRECISE=PRECISE_TRIG, ROUND_BF16=False,
            BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_J=block_j, BLOCK_T=block_t, BLOCK_F=block_f), warps)
    for q, suffix in ((Q, ""), (1, "_q1")):  # a short prefill, and a decode step's one row
        _, block_q, block_d, warps = sr.config(q, 1, H, D, itemsize)
        t = dict(ko_ptr=ptr(DTYPE), vo_ptr=ptr(DTYPE), k_ptr=ptr(DTYPE), v_ptr=ptr(DTYPE), rows_ptr=ptr(torch.int64),
                 q=q, H=H, D=D, BLOCK_Q=block_q, BLOCK_D=block_d)
        out["scatter_rows" + suffix] = (sr._scatter_rows_aligned, dict(
            t, so_b=0, so_h=CAP * D, so_r=D, si_b=0, si_h=D, si_r=3 * H * D, VEC=vec), warps)
        # the generic variant as a transposed key view makes it: rows of H * D, heads of D
        out["scatter_rows_generic" + suffix] = (sr._scatter_rows_generic, dict(
            t, sko_b=2 * H * CAP * D, sko_h=CAP * D, sko_r=D, sko_d=1, svo_b=2 * H * CAP * D, svo_h=CAP * D,
            svo_r=D, svo_d=1, sk_b=q * H * D, sk_h=D, sk_r=H * D, sk_d=1, sv_b=q * H * D, sv_h=q * D, sv_r=D,
            sv_d=1), warps)
    from pckernels.kernels.row_attention import kernel as ra
    # a decode step's attention over 8,192 rows: 16 queries with 4 query heads per KV head (GQA
    # 32/8), and one query with one head per KV head (32/32)
    for n, groups, suffix in ((16, 4, ""), (1, 1, "_q1")):
        block_m, block_n, block_d, warps, stages = ra.config(groups, n, D, CAP)
        out["row_attention" + suffix] = (ra._row_attention_split, dict(
            q_ptr=ptr(DTYPE), k_ptr=ptr(DTYPE), v_ptr=ptr(DTYPE), seen_ptr=ptr(torch.uint8),
            group_ptr=ptr(torch.int32), qpos_ptr=ptr(torch.int64), kpos_ptr=ptr(torch.int64),
            start_ptr=ptr(torch.int32), stop_ptr=ptr(torch.int32), acc_ptr=ptr(torch.float32),
            stat_ptr=ptr(torch.float32), n=n, kv=CAP, split_len=256, window=0, scale=0.088,
            s_qh=n * D, s_qn=D, s_kh=CAP * D, s_kn=D, s_vh=CAP * D, s_vn=D, s_seen=CAP,
            GROUPS=groups, D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HAS_WINDOW=False,
            PRECISION="tf32", UPCAST=False), (warps, stages))
    block_m, _, block_d, _, _ = ra.config(4, 16, D, CAP)
    out["row_attention_combine"] = (ra._row_attention_combine, dict(
        acc_ptr=ptr(torch.float32), stat_ptr=ptr(torch.float32), out_ptr=ptr(DTYPE), n=16, splits=32,
        s_on=H * D, s_oh=D, GROUPS=4, D=D, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=32, ROUND_BF16=False), 1)
    return out


def run(names: list[str] | None = None, usage: bool = False) -> tuple[dict, dict]:
    """``(summaries, usage)``: kernel name -> :func:`summary` for the named kernels (all when
    None), and with ``usage`` kernel name -> :func:`ptxas_usage`."""
    tools = offline_compiler()
    if isinstance(tools, str):
        raise RuntimeError(tools)
    results, used = {}, {}
    for name, (fn, args, num_warps) in cases().items():
        if not names or name in names:
            kernel = compile_kernel(fn, args, tools, num_warps)
            results[name] = summary(kernel)
            if usage:
                used[name] = ptxas_usage(kernel)
    return results, used


def table(results: dict, usage: dict | None = None) -> str:
    lines = [f"sm_{ARCH}, {DTYPE}, L={L} H={H} D={D}: global accesses per thread (static count in the PTX)"]
    for name, r in results.items():
        lines.append(f"{name}:" + (f" {usage[name]}" if usage and name in usage else ""))
        for what in ("loads", "stores"):
            lines.append(f"  {what:7s}" + (", ".join(f"{k} x{v}" for k, v in r[what].items()) or "-"))
        lines.append(f"  convert_layout: {'yes' if r['convert_layout'] else 'no'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON object (name -> counts)")
    ap.add_argument("--asm", metavar="KERNEL", help="print this kernel's code instead")
    ap.add_argument("--stage", default="ptx", help="with --asm: ttir, ttgir, llir or ptx")
    args = ap.parse_args(argv)
    tools = offline_compiler()
    if isinstance(tools, str):
        print(tools, file=sys.stderr)
        return 3
    if args.asm:
        fn, kargs, num_warps = cases()[args.asm]
        print(compile_kernel(fn, kargs, tools, num_warps).asm[args.stage])
        return 0
    results, usage = run(usage=True)
    print(table(results, usage))
    if args.json:
        print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
