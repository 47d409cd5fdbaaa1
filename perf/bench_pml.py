"""Benchmark: parse + layout of a ~1 MB PML schema with 1,000 modules, and prompt resolution.

Usage: .venv/bin/python perf/bench_pml.py [--modules 1000] [--repeat 5]

Reports, as medians over ``--repeat`` runs:
* ``parse_schema`` end to end with the embedded SmolLM2 tokenizer (tokenization included);
* parse + layout alone: the same call with a tokenizer that answers from a memo, so the
  tokenizer's own cost drops out; tokenization is the difference;
* ``parse_prompt`` for a prompt importing ten modules with arguments and text.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from pckernels.pml import parse_prompt, parse_schema

WORDS = ("the city river museum market train coffee history harbor bridge garden night "
         "festival local food street music old new tower park north south beach art").split()


class MemoTokenizer:
    """Delegates to a real tokenizer but answers repeated batch calls from a memo."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._memo: dict[tuple, Any] = {}

    def __call__(self, text, add_special_tokens: bool = True):
        key = (tuple(text) if isinstance(text, list) else text, add_special_tokens)
        if key not in self._memo:
            self._memo[key] = self._tokenizer(text, add_special_tokens=add_special_tokens)
        return self._memo[key]

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def make_schema(modules: int, seed: int = 0) -> str:
    """A schema of ``modules`` modules of ~1 KB each: plain, parameterized, nested, unions."""
    rng = random.Random(seed)

    def text(size: int) -> str:
        out: list[str] = []
        length = 0
        while length < size:
            word = rng.choice(WORDS)
            out.append(word)
            length += len(word) + 1
        return " ".join(out) + "."

    parts = ['<schema name="bench">', "<system>You are a helpful travel guide.</system>", "<user>"]
    index = 0
    while index < modules:
        kind = index % 10
        if kind == 0 and index + 4 <= modules:
            parts.append(f'<union name="u{index}">')
            for _ in range(4):
                parts.append(f'<module name="m{index}">{text(1080)}</module>')
                index += 1
            parts.append("</union>")
        elif kind == 5 and index + 2 <= modules:
            parts.append(f'<module name="m{index}">{text(540)}'
                         f'<module name="m{index + 1}">{text(520)}</module></module>')
            index += 2
        else:
            parts.append(f'<module name="m{index}">{text(520)} <param name="p" len="16"/> '
                         f"{text(520)}</module>")
            index += 1
    parts.append("</user></schema>")
    return "\n".join(parts)


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    from pckernels.integration.embedded import load_tokenizer

    tokenizer = load_tokenizer()
    text = make_schema(args.modules)
    schema = parse_schema(text, tokenizer)
    size = len(text.encode("utf-8"))
    tokens = sum(len(m.token_ids) for m in schema.modules.values())
    print(f"schema: {size / 1e6:.2f} MB, {len(schema.modules) - 1} modules, "
          f"{len(schema.unions)} unions, {tokens} own tokens, length {schema.length} positions")

    total = median_time(lambda: parse_schema(text, tokenizer), args.repeat)
    memo = MemoTokenizer(tokenizer)
    parse_schema(text, memo)
    layout = median_time(lambda: parse_schema(text, memo), args.repeat)
    print(f"parse_schema end to end:        {total * 1e3:8.1f} ms")
    print(f"parse + layout (memo tokenizer): {layout * 1e3:8.1f} ms")
    print(f"tokenization (difference):      {(total - layout) * 1e3:8.1f} ms")

    imports = "".join(f'<m{i} p="day {i}"/>' for i in range(7, 1000, 100))
    prompt = f'<prompt schema="bench">{imports}<user>Plan my trip.</user><assistant/></prompt>'
    resolved = parse_prompt(prompt, {"bench": schema})
    elapsed = median_time(lambda: parse_prompt(prompt, {"bench": schema}), args.repeat)
    print(f"parse_prompt ({len(resolved.modules) - 1} imports, {len(resolved.token_ids)} tokens): "
          f"{elapsed * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
