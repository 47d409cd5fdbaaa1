"""Which grammar engine constrains decoding: llguidance, xgrammar and outlines-core side by side.

``python -m perf.bench_grammar [--tokenizers smollm2 PATH] [--out DIR]``

For each tokenizer (the embedded SmolLM2's 49K vocabulary, and a 151K one — Qwen2.5's, from the
second model's GGUF, ``--tokenizers smollm2 /path/to/tokenizer_dir``) and each engine:

* **coverage**: which of a set of JSON schemas (objects, enums, nesting, arrays with bounds,
  ``anyOf`` / ``oneOf``, ``$ref``, patterns, formats, numeric bounds, ``const``,
  ``additionalProperties: false``) it compiles;
* **compile** time of a tool-call schema (first compile, nothing cached);
* **per-token mask** cost: a valid JSON answer tokenized and walked token by token — the time to
  compute the mask of allowed tokens before each one (median and p90, microseconds), the cost a
  constrained request adds to every decode step.

Writes ``grammar.json`` and ``summary.md`` under ``--out`` (default ``perf/results/<machine>/grammar``).
llguidance is promptcache's dependency; the other two are installed for the comparison only
(``pip install xgrammar outlines-core``); an engine that is missing is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "nested": {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city"]}}, "required": ["address"]},
    "array bounds": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                                "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
              "required": ["value"]},
    "oneOf": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"], "additionalProperties": False},
        {"type": "object", "properties": {"w": {"type": "number"}}, "required": ["w"], "additionalProperties": False}]}},
        "required": ["shape"]},
    "$ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                 "required": ["x", "y"]}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
             "required": ["a", "b"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "format": {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                                "mail": {"type": "string", "format": "email"}}, "required": ["when"]},
    "number bounds": {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
                      "required": ["p"]},
    "const": {"type": "object", "properties": {"kind": {"const": "event"}}, "required": ["kind"]},
    "closed object": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
                      "additionalProperties": False},
}
TOOL_SCHEMA = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                  "required": ["city", "unit"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
ANSWER = json.dumps({"name": "get_weather", "arguments": {"city": "San Francisco de la Montana del Norte",
                                                          "unit": "c", "days": 7}})


def load_tokenizer(name: str):
    if name == "smollm2":
        from pckernels.integration.embedded import load_tokenizer as embedded

        return embedded()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab = self.tokenizer.vocab_size
        self.mask = llguidance.torch.allocate_token_bitmask(1, self.vocab)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def step(self, matcher, token: int) -> float:
        t0 = time.perf_counter()
        self.llg.torch.fill_next_token_bitmask(matcher, self.mask, 0)
        seconds = time.perf_counter() - t0
        if not matcher.consume_token(token):
            raise ValueError(f"token {token} refused: {matcher.get_error()}")
        return seconds


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema: dict):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True))

    def step(self, matcher, token: int) -> float:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(self.mask)
        seconds = time.perf_counter() - t0
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} refused")
        return seconds


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.regex = build_regex_from_schema
        vocab: dict[str, list[int]] = {}
        eos = tokenizer.eos_token_id
        for token, index in tokenizer.get_vocab().items():
            if index == eos or index in tokenizer.all_special_ids:
                continue
            vocab.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(index)
        self.vocabulary = outlines_core.Vocabulary(eos, vocab)
        self.mask = torch.zeros((len(tokenizer) + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict):
        return self.oc.Guide(self.oc.Index(self.regex(json.dumps(schema)), self.vocabulary))

    def step(self, guide, token: int) -> float:
        t0 = time.perf_counter()
        guide.write_mask_into(self.mask.data_ptr(), self.mask.numel(), self.mask.element_size())
        seconds = time.perf_counter() - t0
        guide.advance(token)
        return seconds


ENGINES = (Llguidance, Xgrammar, OutlinesCore)


def measure(engine_cls, tokenizer) -> dict:
    try:
        engine = engine_cls(tokenizer)
    except Exception as exc:  # an engine that cannot take this tokenizer is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    coverage = {}
    for name, schema in SCHEMAS.items():
        try:
            engine.compile(schema)
            coverage[name] = True
        except Exception as exc:  # noqa: BLE001  (a refusal is a result)
            coverage[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    t0 = time.perf_counter()
    matcher = engine.compile(TOOL_SCHEMA)
    compile_s = time.perf_counter() - t0
    tokens = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    costs = [engine.step(matcher, token) for token in tokens]
    matcher = engine.compile(TOOL_SCHEMA)
    costs = [engine.step(matcher, token) for token in tokens]
    costs.sort()
    return {"coverage": coverage, "covered": sum(v is True for v in coverage.values()), "schemas": len(SCHEMAS),
            "compile_ms": compile_s * 1e3, "tokens": len(tokens),
            "mask_us_median": statistics.median(costs) * 1e6, "mask_us_p90": costs[int(0.9 * (len(costs) - 1))] * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_grammar", description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizers", nargs="+", default=["smollm2"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from perf.suite.runner import machine_name

    out = args.out or Path(__file__).resolve().parent / "results" / machine_name() / "grammar"
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.tokenizers:
        tokenizer = load_tokenizer(name)
        results[name] = {"vocab": len(tokenizer), "engines": {cls.name: measure(cls, tokenizer) for cls in ENGINES}}
    (out / "grammar.json").write_text(json.dumps(results, indent=1))
    lines = ["# Grammar engines: JSON-schema coverage and per-token mask cost", "",
             f"`python -m perf.bench_grammar {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             "| vocabulary | engine | schemas compiled | compile (tool schema) | mask per token, median | p90 |",
             "|---|---|---:|---:|---:|---:|"]
    for name, data in results.items():
        for engine, row in data["engines"].items():
            if "error" in row:
                lines.append(f"| {data['vocab']} | {engine} | error: {row['error'][:80]} | | | |")
                continue
            lines.append(f"| {data['vocab']} | {engine} | {row['covered']}/{row['schemas']} | {row['compile_ms']:.1f} ms | "
                         f"{row['mask_us_median']:.0f} µs | {row['mask_us_p90']:.0f} µs |")
    lines += ["", "Refused schemas:"]
    for name, data in results.items():
        for engine, row in data["engines"].items():
            for schema, ok in row.get("coverage", {}).items():
                if ok is not True:
                    lines.append(f"- {data['vocab']} / {engine} / {schema}: {ok}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
