"""Experiment 1 — time to first token vs prompt length (the paper's Fig. 5).

For each length a schema holds one document module of that many tokens; the prompt imports it
and asks a short question. Measured side by side, ``ttft_repeats`` interleaved rounds:

* ``baseline``: plain prefill of the whole prompt (no reuse);
* ``cached``: Prompt Cache with the document's blocks copied from the store into the KV arena
  (resident blocks are evicted first) — what a prompt pays for modules it did not just use;
* ``cached_resident``: Prompt Cache when the blocks already sit in the arena;
* ``floor``: only the forward of the question over the resident cache (no parse, no plan, no
  copy) — no reuse scheme can answer faster.
"""

from __future__ import annotations

import time
from typing import Mapping

import torch

from pckernels.engine import PromptCache
from pckernels.engine.buffer import AssemblyBuffer, BufferCache
from pckernels.engine.plan import plan_request

from perf.suite.breakdown import profile
from perf.suite.context import Bench
from perf.suite.stats import interleaved, paired_ratio, ratio, summarize
from perf.suite.texts import archive, pml_escape, sized

QUESTION = ("Based on the archive above, which goods did the valley towns trade across the passes, and what did "
            "the mills grind?")
SERIES = {"baseline": "no reuse", "cached": "Prompt Cache (blocks copied from the store)",
          "cached_resident": "Prompt Cache (blocks resident)", "floor": "floor (uncached forward only)"}


def archive_schema(tokenizer, n_tokens: int, name: str) -> tuple[str, str]:
    """A schema ``name`` with one ``archive`` module of ``n_tokens`` and a prompt importing it."""
    doc = pml_escape(sized(tokenizer, archive(n_tokens), n_tokens))
    schema = (f'<schema name="{name}"><system>Answer from the archive.\n'
              f'<module name="archive">{doc}</module></system></schema>')
    return schema, f'<prompt schema="{name}"><archive/><user>{QUESTION}</user><assistant/></prompt>'


class _Floor:
    """The prompt's imported blocks already in a private buffer at rows ``0 .. R - 1`` (the rows the
    prompt must not see masked), so timing covers only the forward of its uncached tokens."""

    def __init__(self, engine: PromptCache, prompt: str) -> None:
        resolved = engine.resolve(prompt)
        plan = plan_request(resolved)
        rows = sum(ref.n_rows for ref in plan.blocks)
        self.buffer = buf = AssemblyBuffer(engine.layout, dtype=engine.dtype, device=engine.device,
                                           capacity=rows + len(plan.new_tokens))
        buf.row_bias.zero_()
        row = 0
        with engine.model_lock:
            for ref in plan.blocks:
                block = engine.fetch_block(resolved.schema, ref.module, ref.scaffold, ref.geometry)
                buf.data[:, :, :, row:row + ref.n_rows] = block
                buf.row_pos[row:row + ref.n_rows] = engine.block_positions(resolved.schema, ref.module, ref.scaffold,
                                                                           ref.geometry)
                for hidden in ref.hidden:
                    buf.row_bias[row + hidden] = float("-inf")
                row += ref.n_rows
        self.start, self.extent = row, row + len(plan.new_tokens)
        self.ids = torch.tensor([plan.new_tokens], device=engine.device)
        self.positions = torch.tensor(plan.new_positions, device=engine.device)
        buf.row_pos[row:self.extent] = self.positions
        self.cache = BufferCache(buf)


@torch.inference_mode()
def floor_seconds(engine: PromptCache, prompt: str, floors: dict) -> float:
    """One forward of the prompt's uncached tokens over blocks already resident (no parse, no plan,
    no scheduling, no copy)."""
    floor = floors.get(prompt)
    if floor is None:
        floor = floors[prompt] = _Floor(engine, prompt)
    attention = floor.buffer.attention(floor.positions, floor.extent)
    floor.cache.prepare(rows=None, start=floor.start, extent=floor.extent)
    with engine.model_lock:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        t0 = time.perf_counter()
        logits = engine.adapter.forward(floor.ids, floor.positions[None], attention, floor.cache)
        int(torch.argmax(logits[-1]))
        return time.perf_counter() - t0


def assembled_seconds(engine: PromptCache, prompt: str) -> float:
    """TTFT of Prompt Cache when every block must be copied from the store into the arena."""
    engine.evict_resident()
    return engine.generate(prompt, max_new_tokens=1).ttft_s


def measure_length(bench: Bench, n_tokens: int, tiers: Mapping[str, PromptCache] | None = None) -> dict:
    """Every series at one length, with speed-ups and ratios to the floor.

    ``tiers``: more engines over the same model whose stores keep blocks elsewhere (the GPU
    suite's pinned-host tier); each adds a series ``cached_<name>`` timed like ``cached``."""
    engine, tiers = bench.engine, dict(tiers or {})
    schema, prompt = archive_schema(bench.tokenizer, n_tokens, f"ttft{n_tokens}")
    for each in (engine, *tiers.values()):
        each.add_schema(schema)
        each.generate(prompt, max_new_tokens=1)
    engine.generate(prompt, max_new_tokens=1, mode="baseline")
    floors: dict = {}
    cases = {
        "baseline": lambda: engine.generate(prompt, max_new_tokens=1, mode="baseline").ttft_s,
        "cached": lambda: assembled_seconds(engine, prompt),
        "cached_resident": lambda: engine.generate(prompt, max_new_tokens=1).ttft_s,
        "floor": lambda: floor_seconds(engine, prompt, floors),
    }
    for name, tier in tiers.items():
        cases[f"cached_{name}"] = lambda tier=tier: assembled_seconds(tier, prompt)
    samples = interleaved(cases, rounds(bench), bench.ticker.advance)
    result = engine.generate(prompt, max_new_tokens=1)
    row = {"tokens": result.cached_tokens + result.computed_tokens, "cached_tokens": result.cached_tokens,
           "computed_tokens": result.computed_tokens}
    row.update({name: summarize(values) for name, values in samples.items()})
    row["speedup"] = ratio(row["baseline"], row["cached"])
    row["speedup_resident"] = ratio(row["baseline"], row["cached_resident"])
    for name in tiers:
        row[f"speedup_{name}"] = ratio(row["baseline"], row[f"cached_{name}"])
    row["best_possible"] = ratio(row["baseline"], row["floor"])
    row["cached_over_floor"] = paired_ratio(samples["cached"], samples["floor"])
    row["resident_over_floor"] = paired_ratio(samples["cached_resident"], samples["floor"])
    row["gap_s"] = row["baseline"]["median"] - row["cached"]["median"]
    row["breakdown"] = profile(engine, lambda: assembled_seconds(engine, prompt))
    return row


def rounds(bench: Bench) -> int:
    return bench.config.ttft_repeats or bench.config.repeats


def steps(bench: Bench) -> int:
    return len(bench.config.lengths) * rounds(bench) * len(SERIES)


def run(bench: Bench) -> dict:
    rows = [measure_length(bench, n) for n in bench.config.lengths]
    return {"rows": rows, "question": QUESTION, "series": dict(SERIES), "rounds": rounds(bench),
            "within_15pct_of_floor": all(r["cached_over_floor"] <= 1.15 for r in rows),
            "resident_within_15pct_of_floor": all(r["resident_over_floor"] <= 1.15 for r in rows)}
