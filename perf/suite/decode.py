"""Experiment 6 — decode rate (tokens per second after the first) with and without reuse.

No reuse decodes over a plain ``DynamicCache``; Prompt Cache decodes in its assembly buffer
with a per-row bias (its rows may hold dead parameter slots); exact prefix reuse decodes over a
restored ``DynamicCache``. Greedy, so each method decodes the same number of tokens unless it
meets end-of-sequence, which the rate accounts for.
"""

from __future__ import annotations

from perf.suite.context import Bench
from perf.suite.stats import interleaved, ratio, summarize
from perf.suite.texts import archive, pml_escape, sized

INSTRUCTION = "List every year mentioned in the chronicle with the town and the goods, one per line."


def steps(bench: Bench) -> int:
    return bench.config.repeats * 3


def rate(result) -> float:
    return (len(result.token_ids) - 1) / max(result.total_s - result.ttft_s, 1e-9)


def run(bench: Bench) -> dict:
    engine, prefix, cfg = bench.engine, bench.prefix, bench.config
    doc = pml_escape(sized(bench.tokenizer, archive(21), cfg.decode_context_tokens))
    bench.add_schema(f'<schema name="decode"><system>Answer from the chronicle.\n<module name="chronicle">{doc}'
                     '</module></system></schema>')
    prompt = f'<prompt schema="decode"><chronicle/><user>{INSTRUCTION}</user><assistant/></prompt>'
    ids = list(engine.resolve(prompt).token_ids)
    n = cfg.decode_tokens
    prefix.clear()
    prefix.complete(ids, max_new_tokens=1)
    tokens: dict[str, int] = {}

    def case(method: str, generate):
        def measure() -> float:
            result = generate()
            tokens[method] = len(result.token_ids)
            return rate(result)
        return measure

    samples = interleaved({
        "no_reuse": case("no_reuse", lambda: engine.generate(prompt, max_new_tokens=n, mode="baseline")),
        "prefix": case("prefix", lambda: prefix.complete(ids, max_new_tokens=n)),
        "prompt_cache": case("prompt_cache", lambda: engine.generate(prompt, max_new_tokens=n)),
    }, cfg.repeats, bench.ticker.advance)
    out = {"context_tokens": len(ids), "max_new_tokens": n, "generated_tokens": tokens,
           "tokens_per_s": {m: summarize(v) for m, v in samples.items()}}
    out["prompt_cache_over_no_reuse"] = ratio(out["tokens_per_s"]["prompt_cache"], out["tokens_per_s"]["no_reuse"])
    out["prefix_over_no_reuse"] = ratio(out["tokens_per_s"]["prefix"], out["tokens_per_s"]["no_reuse"])
    return out
