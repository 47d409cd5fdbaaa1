"""Where a decode step and a short prefill over a long cached context go in the native CPU forward.

    python -m perf.profile_cpu [--context 4096] [--new 10] [--threads 2] [--steps 5] [--path auto]

The embedded model (fp32) runs :class:`~pckernels.integration.native.NativeDecoder` over a probe
cache of ``--context`` rows of random keys and values: one decode token, and a prefill of
``--new`` tokens (causal among themselves, every cached row visible). Each is run ``--steps`` times
under ``torch.profiler`` and reported

* by op and input shapes (self CPU time per forward), so the LM head's GEMV, the projections and
  the attention's matmuls show apart;
* per layer: the profiler's events split at each layer's first ``rms_norm`` (two per layer), the
  LM head and final norm last;

with the ISA (:func:`perf.suite.runner.cpu_isa`) and the native forward's CPU path
(``--path``: ``auto`` is what a load picks on this host; see ``CPU_PATHS`` in
:mod:`pckernels.integration.native`). Timings under a profiler are inflated by its per-op cost;
compare paths with ``python -m perf.bench_cpu_paths``, not here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from perf.suite.runner import cpu_isa, cpu_model, machine_name

RESULTS = Path(__file__).resolve().parent / "results"


def probe(decoder, context: int, new: int):
    """``(ids, positions, spec, cache)`` for a forward of ``new`` tokens over ``context`` cached rows."""
    from pckernels.integration.attention import AttentionSpec
    from pckernels.integration.native import _ProbeCache

    g = torch.Generator().manual_seed(0)
    data = torch.randn(len(decoder.layers), 2, decoder.kv_heads, context + new + 8, decoder.head_dim, generator=g)
    cache = _ProbeCache(data)
    cache.write_start, cache.extent = context, context + new
    positions = torch.arange(context, context + new)
    keys = torch.arange(context + new)
    bias = torch.zeros(new, context + new).masked_fill_(keys[None] > positions[:, None], float("-inf"))
    ids = torch.randint(0, decoder.embed.shape[0], (new,), generator=g)
    spec = AttentionSpec(bias, positions, keys)
    return ids, positions, spec, cache


def _shape(event) -> str:
    return "x".join(str(tuple(s)) for s in event.input_shapes if s) if event.input_shapes else ""


def profile(decoder, context: int, new: int, steps: int) -> dict:
    """Op table and per-layer totals (ms per forward) of ``steps`` forwards of ``new`` tokens."""
    ids, positions, spec, cache = probe(decoder, context, new)
    run = lambda: decoder.forward(ids, positions, spec, cache, ids.new_tensor([new - 1]))  # noqa: E731
    run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            run()
    events = [e for e in prof.events() if e.cpu_parent is None or e.cpu_parent.name.startswith("ProfilerStep")]
    by_op: dict[str, float] = defaultdict(float)
    for e in prof.key_averages(group_by_input_shape=True):
        by_op[f"{e.key} {_shape(e)}"] += e.self_cpu_time_total / 1e3 / steps
    top = sorted(by_op.items(), key=lambda kv: -kv[1])
    # per layer: top-level events in time order; each forward has two rms_norms per layer and a
    # final one, so the k-th norm of a forward opens layer k // 2 (the final one: the LM head)
    layers = len(decoder.layers)
    per_layer = [0.0] * (layers + 1)
    norms = 0
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.name == "aten::rms_norm":
            norms += 1
        slot = layers if norms == 0 else min(((norms - 1) % (2 * layers + 1)) // 2, layers)
        per_layer[slot] += e.cpu_time_total / 1e3 / steps
    total = sum(e.cpu_time_total for e in events) / 1e3 / steps
    return {"total_ms": round(total, 2), "ops": [(k.strip(), round(v, 3)) for k, v in top[:25]],
            "per_layer_ms": [round(v, 3) for v in per_layer[:layers]], "head_ms": round(per_layer[layers], 3)}


def main(argv: list[str] | None = None) -> int:
    from pckernels.integration.native import CPU_PATHS

    ap = argparse.ArgumentParser(prog="python -m perf.profile_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=10, help="tokens of the short prefill")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--path", choices=("auto", *CPU_PATHS), default="auto")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from pckernels.integration.embedded import load_model
    from pckernels.integration.native import NativeDecoder

    model = load_model(dtype=torch.float32)
    decoder = NativeDecoder.build(model, [None] * model.config.num_hidden_layers,
                                  cpu_path=None if args.path == "auto" else args.path)
    if decoder is None:
        print("the embedded model has no native forward here", file=sys.stderr)
        return 1
    machine = machine_name()
    result = {"machine": machine, "cpu": cpu_model(), "isa": cpu_isa(), "threads": args.threads,
              "torch": torch.__version__, "path": decoder.cpu_path, "context": args.context,
              "command": "python -m perf.profile_cpu " + " ".join(sys.argv[1:] if argv is None else argv)}
    lines = [f"# Native CPU forward by op and layer — {machine}, path {decoder.cpu_path}", "",
             f"{args.threads} threads, {result['cpu']} ({result['isa']['summary']}), torch {torch.__version__}; "
             f"{args.context} cached rows; ms per forward under torch.profiler (inflated by its per-op cost), "
             f"mean of {args.steps}. Command: `{result['command']}`"]
    with torch.inference_mode():
        for name, new in (("decode", 1), (f"prefill {args.new}", args.new)):
            part = profile(decoder, args.context, new, args.steps)
            result[name] = part
            lines += ["", f"## {name}: {part['total_ms']:.1f} ms", "", "| op (input shapes) | ms |", "|---|---:|"]
            lines += [f"| `{op}` | {ms:.2f} |" for op, ms in part["ops"][:15]]
            per = part["per_layer_ms"]
            lines += ["", f"Per layer (ms): min {min(per):.2f}, median {sorted(per)[len(per) // 2]:.2f}, "
                      f"max {max(per):.2f}, sum {sum(per):.1f}; final norm + LM head {part['head_ms']:.2f}."]
    out = args.out or RESULTS / machine / "profile"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-{decoder.cpu_path}.json").write_text(json.dumps(result, indent=1))
    (out / f"summary-{decoder.cpu_path}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
