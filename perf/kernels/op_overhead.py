"""Per-call overhead: registered op (``torch.ops.promptcache.*``) vs direct Python call vs raw torch.

CPU, small shapes (decode-sized: one new row per layer), torch path. Each case is timed as
the median over ``--rounds`` rounds of ``--calls`` calls.

    .venv/bin/python perf/kernels/op_overhead.py [--calls 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pckernels import extras, ops
from pckernels.ops import _library as lib


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(min(200, calls)):
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    H, cap, D = 3, 64, 64
    k_out, v_out = torch.zeros(1, H, cap, D), torch.zeros(1, H, cap, D)
    k, v = torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    rows = torch.tensor([17])
    rows64 = rows.long()
    x = torch.randn(1, 9, 1, D)
    pos = torch.tensor([123])
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = torch.randn(1, 1, D), torch.randn(1, 1, D)
    qk = torch.randn(1, 9, 1, D), torch.randn(1, 3, 1, D)
    blocks = [torch.randn(2, 2, H, 4, D)]
    out = torch.zeros(2, 2, H, 8, D)
    table = torch.tensor([[0, 0, 2, 4]])

    groups = {
        "scatter_rows (1 row, H=3, D=64)": {
            "raw torch: 2x index_copy_": lambda: (k_out.index_copy_(2, rows64, k), v_out.index_copy_(2, rows64, v)),
            "direct impl (pckernels.ops API)": lambda: ops.scatter_rows(k_out, v_out, k, v, rows, backend="torch"),
            "impl function": lambda: lib.scatter_rows_impl(k_out, v_out, k, v, rows, "torch"),
            "registered op": lambda: torch.ops.promptcache.scatter_rows(k_out, v_out, k, v, rows, "torch"),
        },
        "apply_rotary_pos_emb (q 9 heads, k 3 heads, 1 token)": {
            "HF apply_rotary_pos_emb": lambda: hf_apply(*qk, cos, sin),
            "direct impl (pckernels.extras API)": lambda: extras.apply_rotary_pos_emb(*qk, cos, sin, backend="torch"),
            "registered op": lambda: torch.ops.promptcache.apply_rotary_pos_emb(*qk, cos, sin, "torch"),
        },
        "rope_at_positions in place (9 heads, 1 token)": {
            "direct impl (pckernels.extras API)": lambda: extras.rope_at_positions(x, pos, inv, backend="torch"),
            "registered op": lambda: torch.ops.promptcache.rope_at_positions_(x, pos, inv, 1.0, "torch"),
        },
        "gather_concat (1 entry, 4 rows)": {
            "direct impl (pckernels.ops API)": lambda: ops.gather_concat(out, blocks, table, backend="torch"),
            "registered op": lambda: torch.ops.promptcache.gather_concat(out, blocks, table, -1, "torch"),
        },
    }
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, {args.calls} calls x {args.rounds} rounds")
    for group, cases in groups.items():
        print(group)
        for name, fn in cases.items():
            print(f"  {name:36s} {per_call_us(fn, args.calls, args.rounds):8.1f} us/call")


if __name__ == "__main__":
    main()
