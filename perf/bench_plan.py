"""What ``PromptCache.request()`` costs in the caller's thread (parse + plan, no forward) against
the number of cached tokens a prompt imports (issue 41: planning flat in cached tokens).

``python -m perf.bench_plan`` (embedded SmolLM2): per ``--tokens`` size a schema whose union holds
a module of that many tokens and one as long with a parameter slot in its middle, installed once; then, per
size, ``request()`` timed as the median of ``--repeat`` calls for four prompts: compact and schema
placement, with and without a parameter argument. ``--profile`` adds a cProfile of one case
(``--profile-case``) at the largest size: the heaviest functions by own time.

``--base PATH`` runs the same measurement in two fresh interpreters, one with ``PYTHONPATH=PATH``
(e.g. a checkout of main) and one with this tree, interleaved over ``--rounds``, and prints both
side by side with the ratio at the largest size over the smallest. Blocks are kept in a disk tier
shared by both (``--store DIR``, else a temporary one), so only the first interpreter encodes the
modules (minutes on a 2-core CPU at 7.5K tokens; a kept ``--store`` skips that next time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "Which goods did the valley towns trade across the passes, and what did the mills grind?"
CASES = ("compact", "schema", "compact_param", "schema_param")


def _schemas(tokenizer, sizes: list[int]) -> tuple[list[str], dict[str, dict[int, str]]]:
    """A schema ``plan{n}`` per size: a union of an ``a`` module of ``n`` tokens and a ``p`` module of
    as many with a parameter slot in its middle; the prompts importing each (keyed by case, size)."""
    from perf.suite.texts import archive, pml_escape, sized

    schemas = []
    prompts: dict[str, dict[int, str]] = {case: {} for case in CASES}
    for i, n in enumerate(sizes):
        doc = pml_escape(sized(tokenizer, archive(500 + i), n))
        half = pml_escape(sized(tokenizer, archive(700 + i), n // 2))
        rest = pml_escape(sized(tokenizer, archive(900 + i), n - n // 2 - 8))
        schemas.append(f'<schema name="plan{n}"><system>Answer from the archive.\n<union name="u">'
                       f'<module name="a">{doc}</module>'
                       f'<module name="p">{half} <param name="note" len="8"/> {rest}</module></union></system></schema>')
        for placement in ("compact", "schema"):
            head = f'<prompt schema="plan{n}" placement="{placement}">'
            tail = f"<user>{QUESTION}</user><assistant/></prompt>"
            prompts[placement][n] = f"{head}<a/>{tail}"
            prompts[f"{placement}_param"][n] = f'{head}<p note="the spring fair"/>{tail}'
    return schemas, prompts


def worker(sizes: list[int], repeat: int, store: str | None, do_profile: bool, profile_case: str) -> dict:
    """Timings of this interpreter's ``pckernels`` (one JSON object)."""
    import torch

    from pckernels import PromptCache

    torch.set_num_threads(1)
    cache = PromptCache.from_pretrained(store_dir=store or False, device_budget="4GiB")
    schemas, prompts = _schemas(cache.tokenizer, sizes)
    t0 = time.perf_counter()
    for schema in schemas:
        cache.add_schema(schema)
    install_s = time.perf_counter() - t0
    out: dict = {"pckernels": __import__("pckernels").__file__, "install_s": install_s, "ms": {}, "min_ms": {}}
    for case in CASES:
        out["ms"][case], out["min_ms"][case] = {}, {}
        for n in sizes:
            prompt = prompts[case][n]
            cache.request(prompt)  # warm: first use of a prompt shape
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                cache.request(prompt)
                times.append(time.perf_counter() - t)
            out["ms"][case][n] = 1e3 * statistics.median(times)
            out["min_ms"][case][n] = 1e3 * min(times)
    if do_profile:
        prof = cProfile.Profile()
        prompt = prompts[profile_case][sizes[-1]]
        prof.enable()
        for _ in range(repeat):
            cache.request(prompt)
        prof.disable()
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]
        out["profile"] = [{"function": f"{Path(f[0]).name}:{f[1]} {f[2]}", "calls": v[1],
                           "own_ms_per_request": 1e3 * v[2] / repeat, "cum_ms_per_request": 1e3 * v[3] / repeat}
                          for f, v in rows]
    return out


def _run_worker(pythonpath: str, args, store: str) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)  # this script by path: the checkout may not have it
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--repeat", str(args.repeat), "--store", store,
           "--tokens", *map(str, args.tokens)]
    done = subprocess.run(cmd, env=env, cwd=pythonpath, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"worker on {pythonpath} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(args) -> dict:
    here = str(Path(__file__).resolve().parents[1])
    base = str(Path(args.base).resolve())
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="bench_plan_") as temporary:
        store = args.store or temporary
        for _ in range(args.rounds):
            for label, path in (("before", base), ("after", here)):
                runs[label].append(_run_worker(path, args, store))
    report: dict = {"settings": {"tokens": args.tokens, "repeat": args.repeat, "rounds": args.rounds,
                                 "before": base, "after": here, "machine": platform.machine(),
                                 "processor": platform.processor(), "cpus": os.cpu_count()}}
    lo, hi = str(args.tokens[0]), str(args.tokens[-1])
    for label, results in runs.items():
        ms = {case: {n: statistics.median(r["ms"][case][n] for r in results) for n in results[0]["ms"][case]}
              for case in CASES}
        best = {case: {n: min(r["min_ms"][case][n] for r in results) for n in results[0]["min_ms"][case]}
                for case in CASES}
        report[label] = {"median_ms": ms, "min_ms": best,
                         "largest_over_smallest": {c: ms[c][hi] / ms[c][lo] for c in CASES}}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_plan", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 7680],
                    help="cached tokens of the imported module (7680: the largest that fits SmolLM2's 8192 "
                         "positions beside the others)")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved before/after runs (with --base)")
    ap.add_argument("--base", default=None, help="a checkout to compare against (its repository root)")
    ap.add_argument("--profile", action="store_true", help="also profile one case at the largest size")
    ap.add_argument("--profile-case", choices=CASES, default="compact_param")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help="disk tier directory for the blocks (kept between runs)")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.tokens, args.repeat, args.store, args.profile, args.profile_case)))
        return 0
    report = compare(args) if args.base else worker(args.tokens, args.repeat, args.store, args.profile,
                                                    args.profile_case)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
