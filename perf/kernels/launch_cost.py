"""Python cost of one Triton-path op call, the ``@triton.jit`` kernels stubbed out: what
``pckernels.ops`` adds before Triton's own launcher (argument checks, backend choice, meta table,
alignment check, staging, grid). CPU only: ``TRITON_INTERPRET=1`` is set so that the Triton path
is chosen, and nothing is launched. CPU time (``process_time``), best of ``--rounds``.

    python -m perf.kernels.launch_cost [--calls 3000] [--rounds 7]

Run it against another tree (e.g. an older commit exported to a folder) with ``PYTHONPATH`` to
compare: the stubs replace every ``@triton.jit`` function the kernel modules hold.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import pckernels  # noqa: E402
from pckernels import ops  # noqa: E402


class _Stub:
    """Stands for a ``@triton.jit`` function: ``stub[grid](*args, **kwargs)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> list[str]:
    """Replace the jit functions of the product kernels' modules; returns their names."""
    from pckernels.kernels.gather_concat import kernel as gc
    from pckernels.kernels.gather_rotate import kernel as gr
    from pckernels.kernels.scatter_rows import kernel as sr

    done = []
    for mod in (gc, gr, sr):
        for name in dir(mod):
            value = getattr(mod, name)
            if name.startswith("_") and hasattr(value, "fn") and hasattr(value, "arg_names"):
                setattr(mod, name, _Stub())
                done.append(f"{mod.__name__.rsplit('.', 2)[-2]}.{name}")
    return done


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(min(300, calls)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    print(f"{pckernels.__file__}; stubbed: {', '.join(stub_kernels())}")
    L, H, D = 4, 8, 64
    dt = torch.bfloat16
    out = torch.zeros(L, 2, H, 64, D, dtype=dt)
    blocks = [torch.zeros(L, 2, H, 8, D, dtype=dt) for _ in range(4)]
    table = torch.tensor([[i, 0, 8 * i, 8] for i in range(4)])
    table5 = torch.tensor([[i, 0, 8 * i, 8, 100 * i] for i in range(4)])
    inv = torch.rand(L, D // 2)

    class Buf:
        data = torch.zeros(L, 2, H, 64, D, dtype=dt)

    k = torch.zeros(1, H, 1, D, dtype=dt)
    v = torch.zeros_like(k)
    rows = torch.tensor([17])
    os.environ["PROMPTCACHE_KERNEL_BACKEND"] = "triton"
    cases = {
        "gather_concat (4 blocks, host table)": lambda: ops.gather_concat(out, blocks, table, backend="triton"),
        "gather_rotate (4 blocks, host table)": lambda: ops.gather_rotate(out, blocks, table5, inv, backend="triton"),
        "scatter_rows (1 row)": lambda: ops.scatter_rows(Buf.data[0, 0:1], Buf.data[0, 1:2], k, v, rows,
                                                          backend="triton"),
        "write_rows (1 row, backend from the env)": lambda: ops.write_rows(Buf, 1, k, v, rows, 0),
    }
    print(f"torch {torch.__version__}, {args.calls} calls x {args.rounds} rounds, CPU us/call (best round)")
    for name, fn in cases.items():
        print(f"  {name:42s} {per_call_us(fn, args.calls, args.rounds):7.1f}")


if __name__ == "__main__":
    main()
