"""Experiment 3 — cache-hit-ratio sweep: a fixed prompt length, the cached fraction from 0 to 1.

A schema holds a document module of ``fraction * hit_ratio_tokens`` tokens; the prompt imports
it and adds uncached log text for the rest, then a question naming the round. Each round uses
fresh uncached text (the same for every method), so exact prefix reuse — primed with the same
document and other text — reuses the document only (up to its last full block), like Prompt
Cache. ``ideal`` is the speed-up if time
were proportional to the computed tokens.
"""

from __future__ import annotations

from perf.suite.context import Bench
from perf.suite.stats import ratio, summarize
from perf.suite.texts import archive, pml_escape, sized, weather_log
from perf.suite.ttft import assembled_seconds

QUESTION = "Which record had the strongest wind?"
METHODS = ("no_reuse", "prefix", "prompt_cache")


def steps(bench: Bench) -> int:
    return len(bench.config.hit_ratios) * bench.config.repeats * len(METHODS)


def measure_fraction(bench: Bench, fraction: float) -> dict:
    engine, prefix, cfg = bench.engine, bench.prefix, bench.config
    cached = round(fraction * cfg.hit_ratio_tokens)
    uncached = cfg.hit_ratio_tokens - cached
    name = f"hit{round(fraction * 1000)}"
    module = f'<module name="doc">{pml_escape(sized(bench.tokenizer, archive(5), cached))}</module>' if cached else ""
    bench.add_schema(f'<schema name="{name}"><system>Read the archive and the log.\n{module}</system></schema>')
    imports = "<doc/>" if cached else ""

    def prompt(variant: int) -> str:
        log_text = pml_escape(sized(bench.tokenizer, weather_log(variant), uncached)) + "\n" if uncached else ""
        return (f'<prompt schema="{name}">{imports}<user>{log_text}{QUESTION} (set {variant})</user>'
                '<assistant/></prompt>')

    prefix.clear()
    primer = prompt(10_000)
    prefix.complete(list(engine.resolve(primer).token_ids), max_new_tokens=1)
    engine.generate(primer, max_new_tokens=1)
    cases = {
        "no_reuse": lambda pml, ids: engine.generate(pml, max_new_tokens=1, mode="baseline").ttft_s,
        "prefix": lambda pml, ids: prefix.complete(ids, max_new_tokens=1).ttft_s,
        "prompt_cache": lambda pml, ids: assembled_seconds(engine, pml),
    }
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    for round_index in range(cfg.repeats):
        pml = prompt(round_index)
        ids = list(engine.resolve(pml).token_ids)
        shift = round_index % len(METHODS)
        for method in METHODS[shift:] + METHODS[:shift]:
            samples[method].append(cases[method](pml, ids))
            bench.ticker.advance()
    result = engine.generate(pml, max_new_tokens=1)
    total = result.cached_tokens + result.computed_tokens
    row = {"fraction": fraction, "prompt_tokens": total, "cached_tokens": result.cached_tokens,
           "computed_tokens": result.computed_tokens}
    row.update({m: summarize(v) for m, v in samples.items()})
    row["speedup_prompt_cache"] = ratio(row["no_reuse"], row["prompt_cache"])
    row["speedup_prefix"] = ratio(row["no_reuse"], row["prefix"])
    row["ideal"] = total / result.computed_tokens
    return row


def run(bench: Bench) -> dict:
    return {"rows": [measure_fraction(bench, f) for f in bench.config.hit_ratios], "question": QUESTION}
