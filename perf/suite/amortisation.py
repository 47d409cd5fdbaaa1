"""Experiment 4 — encoding amortisation: what encoding a module costs against what each query
that reuses it saves, hence the break-even number of reuses.

Per module size, each round encodes a fresh schema (``add_schema`` wall time: parse, tokenize,
forward, store; and the forward part alone from the store's counters), and times a query with
and without reuse. ``break_even_reuses = encode / (no_reuse - prompt_cache)``: after that many
queries Prompt Cache has paid for the encoding.
"""

from __future__ import annotations

import math
import time

from perf.suite.context import Bench
from perf.suite.stats import summarize
from perf.suite.texts import archive, pml_escape, sized
from perf.suite.ttft import assembled_seconds

QUESTION = "Which town counted the most carts, and in which year?"


def steps(bench: Bench) -> int:
    return len(bench.config.amortisation_tokens) * bench.config.repeats * 3


def measure_size(bench: Bench, n_tokens: int) -> dict:
    engine = bench.engine
    doc = pml_escape(sized(bench.tokenizer, archive(9), n_tokens))
    encode_wall, encode_forward, no_reuse, cached = [], [], [], []
    for round_index in range(bench.config.repeats):
        name = f"amort{n_tokens}-{round_index}"
        schema = (f'<schema name="{name}"><system>Answer from the archive.\n<module name="archive">Edition '
                  f'{round_index}. {doc}</module></system></schema>')
        before = engine.stats()["encode_s"]
        t0 = time.perf_counter()
        bench.add_schema(schema)
        encode_wall.append(time.perf_counter() - t0)
        encode_forward.append(engine.stats()["encode_s"] - before)
        bench.ticker.advance()
        prompt = f'<prompt schema="{name}"><archive/><user>{QUESTION}</user><assistant/></prompt>'
        first, second = (("baseline", "cached") if round_index % 2 == 0 else ("cached", "baseline"))
        for mode in (first, second):
            if mode == "baseline":
                no_reuse.append(engine.generate(prompt, max_new_tokens=1, mode="baseline").ttft_s)
            else:
                cached.append(assembled_seconds(engine, prompt))
            bench.ticker.advance()
    row = {"module_tokens": n_tokens, "encode": summarize(encode_wall), "encode_forward": summarize(encode_forward),
           "no_reuse": summarize(no_reuse), "prompt_cache": summarize(cached)}
    saving = row["no_reuse"]["median"] - row["prompt_cache"]["median"]
    row["saving_per_query_s"] = saving
    row["break_even_reuses"] = row["encode"]["median"] / saving if saving > 0 else math.inf
    row["queries_to_pay_back"] = math.ceil(row["break_even_reuses"]) if saving > 0 else None
    return row


def run(bench: Bench) -> dict:
    return {"rows": [measure_size(bench, n) for n in bench.config.amortisation_tokens], "question": QUESTION}
