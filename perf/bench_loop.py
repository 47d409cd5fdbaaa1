"""Running streams while a long cold prompt is read: what it delays them by, and what they delay it by.

``python -m perf.bench_loop [--tree PATH ...] [--prompt-tokens 5000] [--streams 3] [--step-tokens 2048]
[--stream-tokens 1500] [--decode-streams 1 8] [--burst K] [--burst-tokens 256] [--threads 2] [--out DIR]``

On the embedded SmolLM2 (fp32, ``store_dir=False``), in one process per engine:

1. **one step** — ``--streams`` plain requests decoding, then a cold prompt of exactly
   ``--step-tokens`` tokens: the streams' longest gap between two tokens while it is read is one step
   of ``step_tokens`` prompt tokens plus one decode, measured; the streams' median gap before it
   arrived is a decode step alone;
2. **alone** — a cold plain prompt of ``--prompt-tokens`` tokens (``complete``, reuse off: every run
   reads the same chunks) and its time to first token;
3. **with streams** — the streams decoding again, then the long prompt: the streams' longest gap
   while it is read, their median gap, and its time to first token.

``--prompt-tokens 0`` leaves the three phases out. With ``--burst K``, also a burst: ``K`` cold plain
prompts of ``--burst-tokens`` tokens (different documents, reuse off) submitted together, so one
step reads them all: each one's time to first token, in submission order — what a replica behind a
router sees when several new conversations land on it at once.

With ``--decode-streams 1 8``, also the decode rate of that many plain requests together
(``--decode-tokens`` each; tokens/s while all of them decode), to see that decoding is unchanged.

Targets (issue 42): the longest gap at most 2x one step, and the long prompt's TTFT within 1.3x of
its TTFT alone. The streams never end by themselves (their end-of-sequence tokens are biased away)
and are cancelled once the long prompt's first token came.

``--tree PATH`` (repeatable) runs the same measurement on the engine of another checkout — before
and after in one run: each tree's engine in a subprocess with that tree first on ``PYTHONPATH``
(this file is run as a script there, so it needs nothing of that tree but ``pckernels``). Without
``--tree`` the engine this file is imported with is measured. Prints a Markdown table; with
``--out`` also writes ``loop.json`` and ``summary.md`` there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("perf.bench_loop")

GAP_TARGET = 2.0
"""The streams' longest gap while a long prompt is read, at most this many times one step."""
TTFT_TARGET = 1.3
"""The long prompt's TTFT beside the streams, at most this many times its TTFT alone."""
WORDS = ("river", "bridge", "harbour", "tide", "lantern", "orchard", "market", "ledger", "furnace", "quarry")


@dataclass
class Stream:
    """A request decoding in the background: the times its tokens came (``time.monotonic``)."""

    handle: object
    times: list[float] = field(default_factory=list)
    thread: threading.Thread | None = None

    def follow(self) -> None:
        def run():
            try:
                for _ in self.handle:
                    self.times.append(time.monotonic())
            except Exception:  # cancelled at the end of a phase
                pass

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


def gaps(times: list[float], start: float = float("-inf"), end: float = float("inf")) -> list[float]:
    """Gaps between consecutive ``times`` whose interval overlaps ``[start, end]`` (seconds)."""
    return [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]


def document_ids(tokenizer, tokens: int, seed: int) -> list[int]:
    """``tokens`` token ids of plain text, different for every ``seed``."""
    words, ids, i = [], [], 0
    while len(ids) < tokens:
        words.extend(f"{WORDS[(i * 7 + seed) % 10]} {(i * 37 + seed * 101) % 1009} {WORDS[(i * 3 + seed) % 10]}."
                     for i in range(i, i + 200))
        i += 200
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    return ids[:tokens]


@dataclass
class Phase:
    """A prompt read while ``streams`` requests decode: its TTFT, the streams' gaps (seconds)."""

    ttft: float
    longest_gap: float | None = None
    median_gap_before: float | None = None
    median_gap_while: float | None = None


def run_phase(pc, prompt_ids: list[int], *, streams: int, stream_prompt, ban: dict, stream_tokens: int,
              warm_tokens: int = 4) -> Phase:
    """Start ``streams`` decoding requests (each waits for ``warm_tokens`` tokens), then read
    ``prompt_ids`` cold (reuse off) and time its first token; the streams (``stream_tokens`` at
    most, enough to outlast the prompt) are cancelled after."""
    running = []
    for index in range(streams):
        handle = pc.submit(pc.complete_request(stream_prompt(index), max_new_tokens=stream_tokens, logit_bias=ban))
        running.append(Stream(handle))
        running[-1].follow()
    deadline = time.monotonic() + 600
    while any(len(s.times) < warm_tokens and not s.handle.done for s in running) and time.monotonic() < deadline:
        time.sleep(0.005)
    start = time.monotonic()
    handle = pc.submit(pc.complete_request(prompt_ids, max_new_tokens=2, reuse=False))
    first = None
    for _ in handle:
        first = time.monotonic()
        break
    handle.result(timeout=600)
    if running:  # a token after the prompt's first, so the gap across its end is complete
        counts = [len(s.times) for s in running]
        while (any(len(s.times) <= c + 1 and not s.handle.done for s, c in zip(running, counts))
               and time.monotonic() < deadline):
            time.sleep(0.005)
    for stream in running:
        stream.handle.cancel()
    for stream in running:
        stream.thread.join(timeout=60)
    phase = Phase(first - start)
    if running:
        before = [g for s in running for g in gaps([t for t in s.times if t <= start])]
        during = [g for s in running for g in gaps(s.times, start, first)]
        phase.longest_gap = max(during) if during else None
        phase.median_gap_before = statistics.median(before) if before else None
        phase.median_gap_while = statistics.median(during) if during else None
    return phase


def decode_rate(pc, count: int, tokens: int, stream_prompt, ban: dict) -> float:
    """Tokens/s of ``count`` plain requests decoding ``tokens`` tokens each together: the tokens
    chosen while all of them decode (from the last one's first token to the first one's last)."""
    running = [Stream(pc.submit(pc.complete_request(stream_prompt(i), max_new_tokens=tokens, logit_bias=ban)))
               for i in range(count)]
    for stream in running:
        stream.follow()
    for stream in running:
        stream.thread.join(timeout=600)
    start = max(s.times[0] for s in running)
    end = min(s.times[-1] for s in running)
    chosen = sum(1 for s in running for t in s.times if start < t <= end)
    return chosen / (end - start) if end > start else float("nan")


def burst_ttfts(pc, count: int, tokens: int) -> list[float]:
    """``count`` cold plain prompts of ``tokens`` tokens submitted together (under the model lock,
    so one step reads them all): each one's time to first token in submission order (seconds)."""
    prompts = [document_ids(pc.tokenizer, tokens, 20 + i) for i in range(count)]
    with pc.model_lock:
        start = time.monotonic()
        running = [Stream(pc.submit(pc.complete_request(ids, max_new_tokens=2, reuse=False))) for ids in prompts]
    for stream in running:
        stream.follow()
    for stream in running:
        stream.thread.join(timeout=600)
    return [stream.times[0] - start for stream in running]


def measure(pc, *, prompt_tokens: int, streams: int, step_tokens: int, stream_tokens: int = 2000,
            decode_streams: tuple[int, ...] = (), decode_tokens: int = 48, burst: int = 0,
            burst_tokens: int = 256) -> dict:
    """The three phases (module docstring; none with ``prompt_tokens`` 0), the burst and the decode
    rates on engine ``pc``; seconds."""
    tokenizer = pc.tokenizer
    eos = {int(t) for t in getattr(pc, "eos_ids", ()) or ()} | (
        {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    ban = {token: -100.0 for token in eos}

    def stream_prompt(index: int) -> str:
        return f"Once upon a time, by the {WORDS[index % 10]}, story number {index} began:"

    pc.complete(stream_prompt(0), max_new_tokens=4)  # warm up
    out: dict = {"prompt_tokens": prompt_tokens, "streams": streams, "step_tokens": step_tokens}
    if burst:
        out["burst"] = {"count": burst, "tokens": burst_tokens, "ttfts": burst_ttfts(pc, burst, burst_tokens)}
        log.info("burst: %s", out["burst"])
    rates = {}
    for count in decode_streams:
        rates[count] = decode_rate(pc, count, decode_tokens, stream_prompt, ban)
        log.info("decode at %d streams: %.1f tokens/s", count, rates[count])
    out["decode_tokens_per_s"] = rates
    if not prompt_tokens:
        return out
    long_ids = document_ids(tokenizer, prompt_tokens, 1)
    step_ids = document_ids(tokenizer, step_tokens, 2)
    phases = {}
    for name, ids, count in (("one step", step_ids, streams), ("alone", long_ids, 0), ("with streams", long_ids, streams)):
        began = time.monotonic()
        phases[name] = run_phase(pc, ids, streams=count, stream_prompt=stream_prompt, ban=ban,
                                 stream_tokens=stream_tokens)
        log.info("%s: %.1f s, %s", name, time.monotonic() - began, phases[name])
    step, alone, together = phases["one step"], phases["alone"], phases["with streams"]
    one_step = step.longest_gap
    return {
        **out,
        "median_gap_decoding": step.median_gap_before,
        "one_step": one_step,
        "longest_gap_while_read": together.longest_gap,
        "median_gap_while_read": together.median_gap_while,
        "gap_over_step": together.longest_gap / one_step if together.longest_gap and one_step else None,
        "ttft_alone": alone.ttft,
        "ttft_with_streams": together.ttft,
        "ttft_ratio": together.ttft / alone.ttft,
    }


def worker(args) -> dict:
    """Load the embedded model in this process (whichever ``pckernels`` it imports) and measure."""
    import torch

    torch.set_num_threads(args.threads)
    import pckernels
    from pckernels.engine import PromptCache

    pc = PromptCache.from_pretrained("smollm2", store_dir=False, step_tokens=args.step_tokens)
    try:
        out = measure(pc, prompt_tokens=args.prompt_tokens, streams=args.streams, step_tokens=args.step_tokens,
                      stream_tokens=args.stream_tokens, decode_streams=tuple(args.decode_streams),
                      decode_tokens=args.decode_tokens, burst=args.burst, burst_tokens=args.burst_tokens)
    finally:
        pc.close()
    out["pckernels"] = str(Path(pckernels.__file__).resolve().parents[1])
    return out


def run_tree(tree: str, args) -> dict:
    """:func:`worker` in a subprocess with ``tree`` first on ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tree).resolve()), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--prompt-tokens", str(args.prompt_tokens),
               "--streams", str(args.streams), "--step-tokens", str(args.step_tokens), "--threads", str(args.threads),
               "--stream-tokens", str(args.stream_tokens), "--decode-tokens", str(args.decode_tokens),
               "--burst", str(args.burst), "--burst-tokens", str(args.burst_tokens),
               "--decode-streams", *map(str, args.decode_streams)]
    log.info("measuring %s", tree)
    done = subprocess.run(command, env=env, cwd=str(Path(tree).resolve()), stdout=subprocess.PIPE, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the measurement on {tree} failed (its error is above)")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["tree"] = tree
    log.info("%s: %s", tree, out)
    return out


def _ms(value) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms"


def _x(value) -> str:
    return "–" if value is None else f"{value:.2f}x"


def table(rows: list[dict]) -> str:
    """The runs as a Markdown table, with each target's verdict."""
    lines = []
    phased = [row for row in rows if row.get("ttft_alone") is not None]
    if phased:
        lines += ["| engine | median gap, decoding | one step (step_tokens + decode) | longest gap while read | "
                  "gap / step | TTFT alone | TTFT with streams | ratio |",
                  "|---|---|---|---|---|---|---|---|"]
    for row in phased:
        gap_ok = row["gap_over_step"] is not None and row["gap_over_step"] <= GAP_TARGET
        ttft_ok = row["ttft_ratio"] <= TTFT_TARGET
        lines.append(f"| {row.get('tree', row['pckernels'])} | {_ms(row['median_gap_decoding'])} | {_ms(row['one_step'])} "
                     f"| {_ms(row['longest_gap_while_read'])} | {_x(row['gap_over_step'])} {'✓' if gap_ok else '✗'} "
                     f"| {_ms(row['ttft_alone'])} | {_ms(row['ttft_with_streams'])} "
                     f"| {_x(row['ttft_ratio'])} {'✓' if ttft_ok else '✗'} |")
    first = rows[0]
    if first.get("decode_tokens_per_s"):
        counts = list(first["decode_tokens_per_s"])
        lines += ["", "| engine | " + " | ".join(f"decode tokens/s, {c} streams" for c in counts) + " |",
                  "|---|" + "---|" * len(counts)]
        for row in rows:
            rates = row.get("decode_tokens_per_s", {})
            lines.append(f"| {row.get('tree', row['pckernels'])} | "
                         + " | ".join(f"{rates.get(c, float('nan')):.1f}" for c in counts) + " |")
    bursts = [row for row in rows if row.get("burst")]
    if bursts:
        b = bursts[0]["burst"]
        lines += ["", f"| engine | burst of {b['count']} cold {b['tokens']}-token prompts: "
                      "TTFT of each, in submission order | mean |", "|---|---|---|"]
        for row in bursts:
            ttfts = row["burst"]["ttfts"]
            lines.append(f"| {row.get('tree', row['pckernels'])} | {', '.join(_ms(t) for t in ttfts)} "
                         f"| {_ms(statistics.mean(ttfts))} |")
    lines.append("")
    if phased:
        lines.append(f"{first['streams']} streams, a {first['prompt_tokens']}-token cold plain prompt, "
                     f"step_tokens={first['step_tokens']}; targets: gap / step <= {GAP_TARGET}, "
                     f"TTFT ratio <= {TTFT_TARGET}.")
    else:
        lines.append(f"step_tokens={first['step_tokens']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="a checkout to measure (repeatable)")
    ap.add_argument("--prompt-tokens", type=int, default=5000)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stream-tokens", type=int, default=1500,
                    help="each stream's max_new_tokens: enough to outlast the long prompt (they are cancelled then)")
    ap.add_argument("--decode-streams", type=int, nargs="*", default=[],
                    help="also measure decode tokens/s of this many plain requests together (e.g. 1 8)")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--burst", type=int, default=0, help="cold prompts submitted together (0: no burst)")
    ap.add_argument("--burst-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    rows = [run_tree(tree, args) for tree in args.tree] if args.tree else [worker(args)]
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loop.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out / "summary.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
