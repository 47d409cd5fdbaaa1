"""Which matmul a projection of M rows should use on this CPU: MKL's GEMM (``F.linear``), oneDNN's
inner product on the fp32 weights, or oneDNN over packed bf16 weights (``matmul="bf16"``).

    python -m perf.bench_linear [--rows 1 2 4 8 16 32 48 64 128 256] [--threads 2] [--repeats 5]

Every projection of the embedded model (q/k/v and gate/up fused as the native forward runs them,
o, down and the LM head) is multiplied once per repeat by an ``M``-row input; the best repeat is
reported, in milliseconds for the whole model, side by side. ``pckernels.integration.native``
picks oneDNN for fp32 row counts inside ``ONEDNN_ROWS``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from perf.suite.runner import cpu_isa, cpu_model, machine_name

RESULTS = Path(__file__).resolve().parent / "results"


def weights() -> list[torch.Tensor]:
    """The projections the native forward multiplies, fused as it fuses them."""
    from pckernels.integration.embedded import load_model

    model = load_model(dtype=torch.float32)
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out.append(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach())
        out.append(attn.o_proj.weight.detach())
        out.append(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach())
        out.append(mlp.down_proj.weight.detach())
    out.append(model.lm_head.weight.detach())
    return out


def best_ms(fn, ws: list[torch.Tensor], rows: int, dtype: torch.dtype, repeats: int) -> float:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in ws}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in ws:
            fn(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_linear", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64, 128, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from pckernels.integration.native import bf16_matmul_supported

    mkldnn = torch.ops.mkldnn
    fp32 = weights()
    bf16 = [mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 1) for w in fp32] if bf16_matmul_supported() else None
    rows = []
    with torch.inference_mode():
        for m in args.rows:
            row = {"rows": m,
                   "mkl_fp32": best_ms(lambda x, w: torch.nn.functional.linear(x, w), fp32, m, torch.float32,
                                       args.repeats),
                   "onednn_fp32": best_ms(lambda x, w: mkldnn._linear_pointwise(x, w, None, "none", [], ""), fp32, m,
                                          torch.float32, args.repeats)}
            if bf16 is not None:
                row["onednn_bf16_packed"] = best_ms(lambda x, w: mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                                                    bf16, m, torch.bfloat16, args.repeats)
            rows.append(row)
    result = {"machine": machine_name(), "cpu": cpu_model(), "isa": cpu_isa(), "threads": args.threads, "torch": torch.__version__,
              "command": "python -m perf.bench_linear " + " ".join(sys.argv[1:] if argv is None else argv),
              "rows": rows}
    names = [k for k in rows[0] if k != "rows"]
    lines = [f"# Projections of the embedded model, M rows — {result['machine']}", "",
             f"{args.threads} threads, {result['cpu']} ({result['isa']['summary']}), torch {result['torch']}; best of {args.repeats}, ms for all "
             f"projections. Command: `{result['command']}`", "",
             "| rows | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {r['rows']} | " + " | ".join(f"{r[n]:.1f}" for n in names) + " |" for r in rows]
    out = args.out or RESULTS / machine_name() / "linear"
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
