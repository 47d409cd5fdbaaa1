"""The CPU forward as each checkout loads it, before/after, one process per tree, rounds interleaved.

    python -m perf.bench_forward_trees --tree /work/wt/amd-base --tree . [--rounds 5] [--context 4096]
                                       [--threads 2] [--clock wall|cpu] [--engine] [--setup-threads 1]
                                       [--max-seconds 270] [--out DIR]

A process per tree, with that tree first on ``PYTHONPATH``, loads the embedded model (fp32) with the
tree's default CPU path and sets up once on ``--setup-threads`` (one process at a time); then, on
``--threads`` threads,
each round asks every process in turn (the order alternating) for

* **forward**: the native forward alone over a probe cache (as :mod:`perf.profile_cpu`): a decode
  step over ``--context`` rows, 10 new tokens over them, and 8 rows over 512 (an 8-stream step's
  projections); the median of 7 forwards;
* **engine** (``--engine``; the document cached at set-up): decode tokens/s (16 tokens) after a
  cached ``--context``-token document, and a new question after it as a PML module and as a plain
  prompt with ``prefix_resume="token"`` (TTFT), the rows of ``perf.bench_cpu_paths``.

Only one process runs at a time; the others wait on their stdin. ``--clock cpu`` times the forward
in the process's CPU time (one thread on a busy machine); the engine rows are always wall time, so
run them on a quiet machine. Prints, and with ``--out`` writes ``trees.json`` and ``summary.md``:
median (min–max) per tree, the median per-round ratio to the first tree, the load average at start
and end, the ISA, and whether the decoded tokens agreed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("perf.bench_forward_trees")

CHILD = r'''
import json, statistics, sys, time, torch
context, threads, clock, engine_on = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
torch.set_num_threads(int(sys.argv[5]))  # the set-up's threads
tick = time.process_time if clock == "cpu" else time.perf_counter
from pckernels.engine import PromptCache
from perf.profile_cpu import probe
engine = PromptCache.from_pretrained("smollm2", device="cpu", dtype="float32", store_dir=False, prefix_resume="token")
d = engine.adapter.native
cases = {name: probe(d, ctx, new) for name, ctx, new in
         (("decode step ms", context, 1), ("prefill 10 ms", context, 10), ("8 rows over 512 ms", min(context, 512), 8))}
if engine_on:
    from perf.bench_cpu_paths import DECODE_INSTRUCTION, QUESTIONS
    from perf.suite.texts import archive, pml_escape, sized
    doc = pml_escape(sized(engine.tokenizer, archive(31), context))
    engine.add_schema(f'<schema name="trees-{context}"><system>Answer from the chronicle.\n<module name="doc">{doc}'
                      f'</module></system></schema>')
    prompts = [f'<prompt schema="trees-{context}"><doc/><user>{pml_escape(q)}</user><assistant/></prompt>'
               for q in (*QUESTIONS, DECODE_INSTRUCTION)]
    ids = [list(engine.resolve(p).token_ids) for p in prompts]
    engine.complete(ids[0], max_new_tokens=1)  # the document's rows in the prefix cache
    engine.generate(prompts[0], max_new_tokens=1)
    from perf.suite.peer import DocumentCopies
    copies = DocumentCopies(engine, ids[0])  # a cycle of the questions asks under a salt of its own
torch.set_num_threads(threads)
print(json.dumps({"ready": d.cpu_path}), flush=True)
for n, line in enumerate(sys.stdin):
    if line.strip() != "go":
        break
    out = {"path": d.cpu_path}
    with torch.inference_mode():
        for name, (i, pos, spec, cache) in cases.items():
            keep = i.new_tensor([i.shape[0] - 1])
            d.forward(i, pos, spec, cache, keep)
            ts = []
            for _ in range(7):
                t = tick(); d.forward(i, pos, spec, cache, keep); ts.append((tick() - t) * 1e3)
            out[name] = statistics.median(ts)
    if engine_on:
        q = 1 + n % (len(QUESTIONS) - 1)
        out["hit module ms"] = engine.generate(prompts[q], max_new_tokens=1).ttft_s * 1e3
        plain = engine.complete(ids[q], max_new_tokens=1, salt=copies.cycle(n, len(QUESTIONS) - 1))
        copies.check(plain, ids[q])
        out["hit plain, token resume ms"] = plain.ttft_s * 1e3
        decoded = engine.generate(prompts[-1], max_new_tokens=16)
        out["decode tok/s"] = (len(decoded.token_ids) - 1) / max(decoded.total_s - decoded.ttft_s, 1e-9)
        out["decoded"] = decoded.token_ids
    print(json.dumps(out), flush=True)
'''
FORWARD = ("decode step ms", "prefill 10 ms", "8 rows over 512 ms")
ENGINE = ("decode tok/s", "hit module ms", "hit plain, token resume ms")


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """``(busy CPU seconds of the whole machine, CPU seconds of pids)`` since boot (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    busy = sum(fields) - fields[3] - fields[4]  # less idle and iowait
    ours = sum(sum(int(x) for x in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
               for pid in pids)
    return busy / tick, ours / tick


def start_child(tree: str, args: argparse.Namespace) -> subprocess.Popen:
    """A process on ``tree`` that has loaded the model and cached the document (it waits for rounds)."""
    env = {**os.environ, "PYTHONPATH": tree}
    argv = [str(args.context), str(args.threads), args.clock, "1" if args.engine else "0", str(args.setup_threads)]
    child = subprocess.Popen([sys.executable, "-c", CHILD, *argv], env=env, cwd=tree, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    reply(child, tree)
    return child


def reply(child: subprocess.Popen, tree: str) -> dict:
    """The child's next JSON line (its log lines on stderr pass through)."""
    for line in child.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{tree}: the child exited ({child.wait()})")


def run_round(child: subprocess.Popen, tree: str) -> dict:
    """One round in ``child``: ``{metric: value}`` plus ``path`` (and the ``decoded`` tokens)."""
    child.stdin.write("go\n")
    child.stdin.flush()
    return reply(child, tree)


def summarize(trees: list[str], results: dict[str, list[dict]], metrics: list[str]) -> list[str]:
    """Markdown table: median (min–max) per tree and the median per-round ratio to the first tree."""
    names = [f"`{Path(t).name}` ({results[t][0]['path']})" for t in trees]
    lines = ["| measure | " + " | ".join(names) + " | ratio to the first (median per round) |",
             "|---|" + "---:|" * (len(trees) + 1)]
    for metric in metrics:
        cells = []
        for tree in trees:
            values = [r[metric] for r in results[tree]]
            cells.append(f"{statistics.median(values):.3g} ({min(values):.3g}–{max(values):.3g})")
        ratios = [f"{statistics.median(b[metric] / a[metric] for a, b in zip(results[trees[0]], results[t])):.2f}x"
                  for t in trees[1:]]
        lines.append(f"| {metric} | " + " | ".join(cells) + " | " + ", ".join(ratios) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_forward_trees", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="a checkout (repeatable; the first is the base)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--engine", action="store_true", help="also the engine rows (wall time)")
    ap.add_argument("--setup-threads", type=int, default=1,
                    help="threads for loading and caching the document (a busy machine: one is faster)")
    ap.add_argument("--max-seconds", type=float, default=270,
                    help="start no round that would end past this (a perf run stays under 5 minutes)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from perf.suite.runner import cpu_isa, cpu_model, machine_name

    trees = [str(Path(t).resolve()) for t in args.tree]
    commits = {t: subprocess.run(["git", "-C", t, "describe", "--always", "--dirty"], capture_output=True,
                                 text=True, check=False).stdout.strip() for t in trees}
    load = [os.getloadavg()[0]]
    started = time.time()
    children = {}
    try:
        for tree in trees:  # one at a time: a set-up does not overlap another's
            children[tree] = start_child(tree, args)
            log.info("%s ready after %.0f s", tree, time.time() - started)
        rounds_started = time.time()
        pids = [child.pid for child in children.values()]
        cpu_start = cpu_seconds(pids)
        results: dict[str, list[dict]] = {t: [] for t in trees}
        for r in range(args.rounds):
            if r and time.time() - started + (time.time() - rounds_started) / r > args.max_seconds:
                log.warning("stopping after %d rounds: the next would pass --max-seconds %d", r, args.max_seconds)
                break
            for tree in trees if r % 2 == 0 else trees[::-1]:
                results[tree].append(run_round(children[tree], tree))
                log.info("round %d %s: %s", r, tree,
                         json.dumps({k: v for k, v in results[tree][-1].items() if k != "decoded"}))
        cpu_end = cpu_seconds(pids)
    finally:
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=60)
    load.append(os.getloadavg()[0])
    elapsed = time.time() - rounds_started
    others = (cpu_end[0] - cpu_start[0] - (cpu_end[1] - cpu_start[1])) / elapsed  # cores' worth, other jobs
    metrics = list(FORWARD) + (list(ENGINE) if args.engine else [])
    command = "python -m perf.bench_forward_trees " + " ".join(sys.argv[1:] if argv is None else argv)
    isa = cpu_isa()
    busy = max(load) > (os.cpu_count() or 1) + 0.5
    lines = [f"# The CPU forward before/after — {machine_name()}", "",
             f"{args.threads} threads, {cpu_model()} ({isa['summary']}). {len(results[trees[0]])} rounds, one process per "
             f"tree (order alternating per round), medians; forward in "
             f"{'CPU time of the process' if args.clock == 'cpu' else 'wall time'}"
             + (", engine rows in wall time" if args.engine else "")
             + f". Load average (1 min) at start / end {load[0]:.2f} / {load[1]:.2f} on {os.cpu_count()} cores"
             + (" (busy: compare the trees, not the absolute figures)" if busy else "")
             + f"; other jobs used {others:.2f} cores on average during the rounds"
             + f"; set-up {rounds_started - started:.0f} s, rounds {elapsed:.0f} s.", "",
             f"Command: `{command}`", "",
             "Trees: " + ", ".join(f"`{t}` at {commits[t]}" for t in trees), "",
             *summarize(trees, results, metrics)]
    if args.engine:
        same = len({json.dumps(r["decoded"]) for t in trees for r in results[t]}) == 1
        lines += ["", f"Decoded tokens equal across trees and rounds: {'yes' if same else 'NO'}"]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "trees.json").write_text(json.dumps({"command": command, "commits": commits, "isa": isa,
                                                         "threads": args.threads, "clock": args.clock,
                                                         "load_average": load, "other_jobs_cores": others,
                                                         "results": results}, indent=1))
        (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
