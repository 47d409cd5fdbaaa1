"""The native forward's fp32 CPU paths side by side, in one process, on this host.

    python -m perf.bench_cpu_paths [--paths linear per-row ...] [--context 4096] [--repeats 3]
                                   [--threads 2] [--no-engine] [--cold-repeats 2] [--clock wall|cpu]

Every round runs every path once (the order rotating), switching the loaded decoder with
:meth:`~pckernels.integration.native.NativeDecoder.set_cpu_path`, so load that drifts between
rounds hits the paths alike; tables show the median (min–max) per path and the median of the
per-round ratios to the first path. Two levels:

* **forward**: the native forward alone over a probe cache of ``--context`` random rows (as
  ``perf.profile_cpu``): one decode step, and a prefill of 10 tokens; and 8 rows over 512 cached
  ones (the projections see what an 8-stream decode step gives them; the attention differs);
* **engine** (the embedded model, the issue-45 rows; ``--no-engine`` skips it): decode tokens/s
  after a cached document (module prompt), a new question after the cached document as a PML
  module and as a plain prompt with ``prefix_resume="token"`` (TTFT), and the cold prefill of the
  whole prompt (``complete(reuse=False)``, ``--cold-repeats`` rounds).

The first greedy token of every hit and the decoded tokens are compared across paths (they may
differ only at a near-tie: the paths agree to rounding). The ISA and the path a load picks here
are recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from perf.suite.peer import DocumentCopies
from perf.suite.runner import cpu_isa, cpu_model, machine_name

RESULTS = Path(__file__).resolve().parent / "results"
QUESTIONS = ("How many tons of copper did the mills grind?", "Which town counted the most carts of wool?",
             "In which year was the river bridge repaired in winter?", "Name a town that ground barley.",
             "How many carts of salt went to Corran?", "Which goods did Fenwick send most often?")
DECODE_INSTRUCTION = "List every year mentioned in the chronicle with the town and the goods, one per line."


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _rounds(paths: list[str], repeats: int, set_path, measure) -> dict[str, dict[str, list[float]]]:
    """``{metric: {path: [value per round]}}``: ``measure()`` returns ``{metric: value}``."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in range(repeats):
        order = paths[r % len(paths):] + paths[:r % len(paths)]
        for path in order:
            set_path(path)
            for metric, value in measure().items():
                out.setdefault(metric, {}).setdefault(path, []).append(value)
    return out


def forward_rounds(decoder, paths: list[str], context: int, repeats: int, steps: int = 5,
                   clock=time.perf_counter) -> dict:
    """Decode step and 10-token prefill (ms) of the native forward alone, per path (``clock``:
    ``time.process_time`` counts CPU time, which a busy machine's descheduling leaves out)."""
    from perf.profile_cpu import probe

    cases = {name: probe(decoder, context, new) for name, new in (("decode step ms", 1), ("prefill 10 ms", 10))}
    cases["8 rows over 512 ms"] = probe(decoder, min(context, 512), 8)  # the projections of an 8-stream step

    def measure():
        out = {}
        for name, (ids, positions, spec, cache) in cases.items():
            keep = ids.new_tensor([ids.shape[0] - 1])
            decoder.forward(ids, positions, spec, cache, keep)
            times = []
            for _ in range(steps):
                t0 = clock()
                decoder.forward(ids, positions, spec, cache, keep)
                times.append((clock() - t0) * 1e3)
            out[name] = statistics.median(times)
        return out

    with torch.inference_mode():
        return _rounds(paths, repeats, decoder.set_cpu_path, measure)


def engine_rounds(engine, paths: list[str], context: int, repeats: int, cold_repeats: int,
                  decode_tokens: int, cpu_clock: bool = False) -> tuple[dict, dict]:
    """The issue-45 rows per path (module docstring) and the tokens each path chose. ``cpu_clock``:
    each row from the process's CPU time around the call (one thread only: a busy machine's
    descheduling left out), decode as the CPU time of ``decode_tokens`` tokens less that of one."""
    from perf.suite.texts import archive, pml_escape, sized

    doc = pml_escape(sized(engine.tokenizer, archive(31), context))
    engine.add_schema(f'<schema name="paths-{context}"><system>Answer from the chronicle.\n<module name="doc">{doc}'
                      f'</module></system></schema>')
    prompts = [f'<prompt schema="paths-{context}"><doc/><user>{pml_escape(q)}</user><assistant/></prompt>'
               for q in (*QUESTIONS, DECODE_INSTRUCTION)]
    ids = [list(engine.resolve(p).token_ids) for p in prompts]
    native = engine.adapter.native
    tokens: dict[str, dict[str, list]] = {}
    state = {"round": 0}
    copies = DocumentCopies(engine, ids[0])  # each path (and cycle of questions) asks under a salt of its own

    def keep(path, name, value):
        tokens.setdefault(name, {}).setdefault(path, []).append(value)

    def measure():
        path = native.cpu_path
        out = {}
        if state["round"] < cold_repeats * len(paths):
            engine.prefix.clear()
            copies.cleared()
            out["cold prefill s"] = engine.complete(ids[0], max_new_tokens=1, reuse=False).ttft_s
        group = state["round"] // len(paths)
        question = 1 + group % (len(QUESTIONS) - 1)
        salt = copies.cycle(group, len(QUESTIONS) - 1, tag=path)
        state["round"] += 1
        t0 = time.process_time()
        module = engine.generate(prompts[question], max_new_tokens=1)
        t1 = time.process_time()
        plain = engine.complete(ids[question], max_new_tokens=1, salt=salt)
        t2 = time.process_time()
        copies.check(plain, ids[question])
        out["hit module ms"] = ((t1 - t0) if cpu_clock else module.ttft_s) * 1e3
        out["hit plain, token resume ms"] = ((t2 - t1) if cpu_clock else plain.ttft_s) * 1e3
        keep(path, f"first token q{question}", [module.token_ids[0], plain.token_ids[0]])
        t0 = time.process_time()
        decoded = engine.generate(prompts[-1], max_new_tokens=decode_tokens)
        t1 = time.process_time()
        if cpu_clock:
            engine.generate(prompts[-1], max_new_tokens=1)
            seconds = (t1 - t0) - (time.process_time() - t1)
        else:
            seconds = decoded.total_s - decoded.ttft_s
        out["decode tok/s"] = (len(decoded.token_ids) - 1) / max(seconds, 1e-9)
        keep(path, "decoded", decoded.token_ids)
        return out

    engine.complete(ids[0], max_new_tokens=1)
    engine.generate(prompts[0], max_new_tokens=1)
    return _rounds(paths, repeats, native.set_cpu_path, measure), tokens


def table(rounds: dict, paths: list[str]) -> list[str]:
    lines = ["| measure | " + " | ".join(paths) + f" | ratio to {paths[0]} (median per round) |",
             "|---|" + "---:|" * (len(paths) + 1)]
    for metric, per in rounds.items():
        cells = []
        for path in paths:
            s = _summary(per[path])
            cells.append(f"{s['median']:.3g} ({s['min']:.3g}–{s['max']:.3g})")
        ratios = []
        for path in paths[1:]:
            pairs = [b / a for a, b in zip(per[paths[0]], per[path])]
            ratios.append(f"{path} {statistics.median(pairs):.2f}x")
        lines.append(f"| {metric} | " + " | ".join(cells) + " | " + ", ".join(ratios) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from pckernels.integration.native import CPU_PATHS

    ap = argparse.ArgumentParser(prog="python -m perf.bench_cpu_paths", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", choices=CPU_PATHS, default=list(CPU_PATHS))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold-repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-forward", action="store_true", help="skip the forward-alone rounds")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (one thread on a busy machine; cold prefill stays wall)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    from pckernels.engine import PromptCache

    load = [os.getloadavg()[0]]
    engine = PromptCache.from_pretrained("smollm2", device="cpu", dtype="float32", store_dir=False,
                                         prefix_resume="token")
    decoder = engine.adapter.native
    if decoder is None:
        print("the embedded model has no native forward here", file=sys.stderr)
        return 1
    loaded_path = decoder.cpu_path
    machine = machine_name()
    result = {"machine": machine, "cpu": cpu_model(), "isa": cpu_isa(), "threads": args.threads,
              "torch": torch.__version__, "loaded_path": loaded_path, "paths": args.paths,
              "command": "python -m perf.bench_cpu_paths " + " ".join(sys.argv[1:] if argv is None else argv)}
    result["clock"] = args.clock
    from perf.bench_forward_trees import cpu_seconds

    cpu_start, t_start = cpu_seconds([os.getpid()]), time.time()
    if not args.no_forward:
        result["forward"] = forward_rounds(decoder, args.paths, args.context, args.repeats,
                                           clock=time.process_time if args.clock == "cpu" else time.perf_counter)
    if not args.no_engine:
        result["engine"], result["tokens"] = engine_rounds(engine, args.paths, args.context, args.repeats,
                                                           args.cold_repeats, args.decode_tokens,
                                                           cpu_clock=args.clock == "cpu")
    result["plans"] = {}
    for path in args.paths:
        decoder.set_cpu_path(path)
        result["plans"][path] = {"plans": decoder.plans(), "extra_mb": round(decoder.extra_bytes() / 1e6, 1)}
    decoder.set_cpu_path(loaded_path)
    load.append(os.getloadavg()[0])
    cpu_end = cpu_seconds([os.getpid()])
    others = (cpu_end[0] - cpu_start[0] - (cpu_end[1] - cpu_start[1])) / (time.time() - t_start)
    result["load_average"], result["other_jobs_cores"] = load, others
    busy = max(load) > (os.cpu_count() or 1) + 0.5
    lines = [f"# The native forward's CPU paths — {machine}", "",
             f"{args.threads} threads, {result['cpu']} ({result['isa']['summary']}), torch {torch.__version__}; "
             f"a load here picks `{loaded_path}`. {args.repeats} interleaved rounds, median (min–max), "
             f"{'CPU time of the process (cold prefill: wall)' if args.clock == 'cpu' else 'wall time'}. "
             f"Load average (1 min) at start / end {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores"
             + (" — the machine was busy: compare the paths, not the absolute figures" if busy else "")
             + f"; other jobs used {others:.2f} cores on average while it measured.",
             "", f"Command: `{result['command']}`", "",
             *([f"## The native forward alone, {args.context} cached rows", "", *table(result["forward"], args.paths)]
               if "forward" in result else [])]
    if "engine" in result:
        same = {name: len({json.dumps(v) for per in by_path.values() for v in per}) == 1
                for name, by_path in result["tokens"].items()}
        result["tokens_equal"] = same
        lines += ["", f"## Engine, embedded SmolLM2 fp32, a {args.context}-token document", "",
                  *table(result["engine"], args.paths), "",
                  "Tokens equal across paths: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items())]
    lines += ["", "Plans (kernel per row class one / few / many; MB of transposed copies):", ""]
    for path, info in result["plans"].items():
        kinds = ", ".join(f"{kind} {p['one']}/{p['few']}/{p['many']}" for kind, p in info["plans"].items())
        lines.append(f"* `{path}`: {kinds}; {info['extra_mb']} MB")
    out = args.out or RESULTS / machine / "cpu-paths"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu-paths.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
