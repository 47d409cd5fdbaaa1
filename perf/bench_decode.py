"""Where one decode step of the native forward goes, against the memory it must read and llama.cpp's step.

    python -m perf.bench_decode [--contexts 4125 8064] [--threads 2] [--repeats 15] [--matmul fp32|bf16]

For each context length T the embedded model's :class:`~pckernels.integration.native.NativeDecoder`
decodes one token over T cached rows (random keys and values), and the same step is taken apart:

* ``weights``: every projection and the LM head on a one-row input, as the step calls them;
* ``attention``: the step's attention (``NativeDecoder._attend``) over the T+1 rows of every layer;
* ``rest``: the step less both — norms, RoPE, residuals, KV writes, Python;
* ``floor``: the bytes the step must read (weights, keys and values) at this machine's streaming
  rate (``torch.sum`` over a buffer larger than the last-level cache share, same threads).

Components are timed round-robin (median of ``--repeats``) so drift hits them alike. Where
``perf/results/<machine>/llamacpp/suite.json`` exists (``python -m perf --only llamacpp``), its
decode rates at the nearest context are shown beside, as milliseconds per step.

``--kernels`` adds the attention's matmuls alone, for one KV head of T rows over a pool of heads
larger than the cache (so every call reads memory), in GB/s: the GQA group's scores as the step
runs them (``mm(q[G], K^T)``), one query row, the same scores were keys stored transposed, the
values' matmul, and ``sum(K)`` as the streaming reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from perf.suite.runner import cpu_isa, cpu_model, machine_name

RESULTS = Path(__file__).resolve().parent / "results"
STREAM_BYTES = 1 << 30


def stream_gbs(threads: int, repeats: int = 5) -> float:
    """GB/s of ``torch.sum`` over a 1 GiB fp32 buffer: the rate a step's reads can reach."""
    data = torch.ones(STREAM_BYTES // 4)
    data.sum()
    best = min(_timed(data.sum) for _ in range(repeats))
    del data
    return STREAM_BYTES / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peer_steps(machine: str) -> dict[int, dict[str, float]]:
    """``{context: {set-up: ms per decode step}}`` from the llama.cpp peer run, if one was saved."""
    path = RESULTS / machine / "llamacpp" / "suite.json"
    if not path.exists():
        return {}
    contexts = json.loads(path.read_text())["experiments"]["llamacpp"]["contexts"]
    return {c["context_tokens"]: {name: 1e3 / rate["median"] for name, rate in c["decode_tokens_per_s"].items()}
            for c in contexts}


def budget(decoder, context: int, repeats: int) -> dict[str, float]:
    """Median ms of a decode step at ``context`` cached rows and of its parts (module docstring)."""
    from pckernels.integration.attention import AttentionSpec
    from pckernels.integration.native import _ProbeCache

    layers = len(decoder.layers)
    data = torch.randn(layers, 2, decoder.kv_heads, context + 8, decoder.head_dim)
    cache = _ProbeCache(data)
    cache.write_start, cache.extent = context, context + 1
    ids = torch.tensor([decoder.embed.shape[0] // 2])
    position = torch.tensor([context])
    spec = AttentionSpec(torch.zeros(1, context + 1), position, torch.arange(context + 1))
    inputs = {width: torch.randn(1, width) for width in {p.weight.shape[1] for p in decoder.projections()}}
    q = torch.randn(1, decoder.q_heads, decoder.head_dim)
    bias = torch.zeros(1, context + 1)

    def step():
        decoder.forward(ids, position, spec, cache, None)

    def weights():
        for projection in decoder.projections():
            projection(inputs[projection.weight.shape[1]])

    def attention():
        for index, layer in enumerate(decoder.layers):
            keys, values = data[index, 0, :, :context + 1], data[index, 1, :, :context + 1]
            decoder._attend(q, keys, values, bias, layer.scaling, {}, None)

    parts = {"step": step, "weights": weights, "attention": attention}
    samples: dict[str, list[float]] = {name: [] for name in parts}
    with torch.inference_mode():
        for fn in parts.values():
            fn()
        for _ in range(repeats):
            for name, fn in parts.items():
                samples[name].append(_timed(fn) * 1e3)
    out = {name: statistics.median(values) for name, values in samples.items()}
    out["rest"] = out["step"] - out["weights"] - out["attention"]
    return out


def kernels(decoder, context: int, repeats: int, pool_bytes: int = STREAM_BYTES) -> dict[str, float]:
    """GB/s of the attention's matmuls for one KV head of ``context`` rows over ``pool_bytes`` of
    heads (module docstring)."""
    groups = decoder.q_heads // decoder.kv_heads
    rows = context * decoder.head_dim
    count = max(8, pool_bytes // (rows * 4))
    pool = torch.randn(count, context, decoder.head_dim)
    pool_t = torch.randn(count, decoder.head_dim, context)
    q = torch.randn(groups, decoder.head_dim)
    p = torch.softmax(torch.randn(groups, context), dim=-1)
    cases = {
        "scores mm(q[G], K^T)": (lambda k: torch.mm(q, k.t()), pool),
        "scores mm(q[1], K^T)": (lambda k: torch.mm(q[:1], k.t()), pool),
        "scores, K stored transposed": (lambda k: torch.mm(q, k), pool_t),
        "values mm(p[G], V)": (lambda v: torch.mm(p, v), pool),
        "sum(K)": (lambda k: k.sum(), pool),
    }
    out = {}
    with torch.inference_mode():
        for name, (fn, data) in cases.items():
            def sweep(fn=fn, data=data):
                for i in range(count):
                    fn(data[i])

            sweep()
            best = min(_timed(sweep) for _ in range(repeats))
            out[name] = round(count * rows * 4 / best / 1e9, 1)
    return out


def weight_bytes(decoder) -> int:
    total = 0
    for projection in decoder.projections():
        weight = projection.weight if projection.packed is None else projection.packed
        total += weight.numel() * weight.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4125, 8064])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--matmul", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--kernels", action="store_true", help="also the attention's matmuls alone, in GB/s")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from pckernels.integration.embedded import load_model
    from pckernels.integration.native import NativeDecoder

    model = load_model(dtype=torch.float32)
    decoder = NativeDecoder.build(model, [None] * model.config.num_hidden_layers, args.matmul)
    if decoder is None:
        print("the embedded model has no native forward here", file=sys.stderr)
        return 1
    rate = stream_gbs(args.threads)
    machine = machine_name()
    peers = peer_steps(machine)
    wbytes = weight_bytes(decoder)
    rows = []
    for context in args.contexts:
        parts = budget(decoder, context, args.repeats)
        kv_bytes = len(decoder.layers) * 2 * decoder.kv_heads * (context + 1) * decoder.head_dim * 4
        row = {"context": context, **{k: round(v, 2) for k, v in parts.items()},
               "weights_floor": round(wbytes / rate / 1e6, 2), "attention_floor": round(kv_bytes / rate / 1e6, 2),
               "weights_gbs": round(wbytes / parts["weights"] / 1e6, 1),
               "attention_gbs": round(kv_bytes / parts["attention"] / 1e6, 1)}
        if peers:
            nearest = min(peers, key=lambda c: abs(c - context))
            row["peer_context"] = nearest
            row["peer_ms"] = {name: round(ms, 2) for name, ms in peers[nearest].items()}
        if args.kernels:
            row["kernels_gbs"] = kernels(decoder, context, max(3, args.repeats // 3))
        rows.append(row)
    result = {"machine": machine, "cpu": cpu_model(), "isa": cpu_isa(), "cpu_path": decoder.cpu_path,
              "threads": args.threads, "torch": torch.__version__,
              "matmul": args.matmul, "stream_gbs": round(rate, 1), "weight_bytes": wbytes,
              "command": "python -m perf.bench_decode " + " ".join(sys.argv[1:] if argv is None else argv),
              "rows": rows}
    header = (f"{args.threads} threads, {result['cpu']} ({result['isa']['summary']}; CPU path "
              f"{decoder.cpu_path}), torch {result['torch']}; median of {args.repeats}, ms. "
              f"Streaming rate {rate:.1f} GB/s (`torch.sum`, 1 GiB); weights {wbytes / 1e6:.0f} MB per step. "
              f"Command: `{result['command']}`")
    lines = [f"# One decode step of the native forward, {args.matmul} matmuls — {machine}", "", header, "",
             "| context | step | weights (floor, GB/s) | attention (floor, GB/s) | rest | llama.cpp step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        peer = ", ".join(f"{name} {ms:.1f}" for name, ms in r.get("peer_ms", {}).items()
                         if name.startswith("llama.cpp")) or "—"
        lines.append(f"| {r['context']} | {r['step']:.1f} | {r['weights']:.1f} ({r['weights_floor']:.1f}, "
                     f"{r['weights_gbs']:.1f}) | {r['attention']:.1f} ({r['attention_floor']:.1f}, "
                     f"{r['attention_gbs']:.1f}) | {r['rest']:.1f} | {peer} |")
    if args.kernels:
        names = list(rows[0]["kernels_gbs"])
        lines += ["", f"Attention's matmuls alone, one KV head, GB/s (streaming rate {rate:.1f}):", "", "| context | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {r['context']} | " + " | ".join(f"{r['kernels_gbs'][n]:.1f}" for n in names) + " |"
                  for r in rows]
    out = args.out or RESULTS / machine / "decode"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode-{args.matmul}.json").write_text(json.dumps(result, indent=1))
    (out / f"summary-{args.matmul}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
