"""Error of re-rotating cached keys, R(d) R(p) k, vs encoding directly at p + d, R(p + d) k.

Keys ``[L, H, n, D]`` (SmolLM2 shape: L=30, H=3, D=64, theta=10000 unless overridden) are
rotated at positions ``p0 .. p0 + n`` in fp32, stored in the cache dtype, re-rotated by d
(fp32 math, one rounding) and compared with keys rotated directly at p + d and stored in
the same dtype. Reports max abs error, and max abs error relative to max |k|.

    .venv/bin/python perf/kernels/rerotate_error.py [--theta 10000] [--n 512]
"""

from __future__ import annotations

import argparse

import torch

from pckernels import extras


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--theta", type=float, default=10000.0)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--backend", default="torch")
    args = ap.parse_args()
    L, H, D = 30, 3, 64
    torch.manual_seed(0)
    inv = 1.0 / (args.theta ** (torch.arange(0, D, 2).float() / D))
    raw = torch.randn(L, H, args.n, D)
    scale = raw.abs().max().item()
    print(f"L={L} H={H} n={args.n} D={D} theta={args.theta:g} backend={args.backend}")
    print(f"{'dtype':9s} {'p0':>6s} {'delta':>7s} {'max abs err':>12s} {'rel to max|k|':>14s} "
          f"{'direct-vs-fp64 err':>18s}")
    for dtype in (torch.float32, torch.bfloat16):
        for p0, delta in ((0, 1), (0, 512), (100, 4000), (4000, -3900), (30000, 2000)):
            p = torch.arange(p0, p0 + args.n)
            cached = extras.rope_at_positions(raw.clone(), p, inv, backend=args.backend).to(dtype)
            moved = extras.rerotate_keys(cached.clone(), delta, inv, backend=args.backend).float()
            direct = extras.rope_at_positions(raw.clone(), p + delta, inv, backend=args.backend).to(dtype).float()
            ang = (p + delta).double()[:, None] * inv.double()
            c, s = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
            r64 = raw.double()
            exact = r64 * c + torch.cat((-r64[..., D // 2:], r64[..., :D // 2]), -1) * s
            err = (moved - direct).abs().max().item()
            err_direct = (direct.double() - exact).abs().max().item()
            print(f"{str(dtype)[6:]:9s} {p0:6d} {delta:7d} {err:12.3e} {err / scale:14.3e} {err_direct:18.3e}")


if __name__ == "__main__":
    main()
