"""Constrained decoding: answers that follow a JSON schema, any JSON object, a regex or a grammar.

Backed by llguidance (chosen by measurement, ``perf/bench_grammar.py``: on this CPU it compiles a
tool-call schema in under 1 ms against 6-30 ms for xgrammar and 100-200 ms for outlines-core at
49K and 152K vocabularies, covers the same JSON-schema features there, computes a token mask in
22-33 µs — under 0.1% of a decode step — and needs no other package). A :class:`Grammar` is
compiled once per request and gives each answer a :class:`Matcher`: before every token the
matcher masks the logits of the tokens the grammar forbids, after it the chosen token is
accepted. The scheduler does this per request inside one batched step, and a draft token the
grammar forbids is never chosen, so lookahead rejects it.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON answers are laid out on one line as ``json.dumps`` writes them: no runs of whitespace a weak
or random model could loop in, and the spacing models are trained on."""


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled (the message says why)."""


class Matcher:
    """One answer's place in a grammar (:meth:`Grammar.matcher`)."""

    def __init__(self, matcher, vocab: int) -> None:
        import llguidance.torch

        self._matcher = matcher
        self._vocab = vocab
        self._apply = llguidance.torch.apply_token_bitmask_inplace
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def mask_(self, scores: torch.Tensor) -> None:
        """Set the logits ``scores [vocab]`` of every token the grammar forbids next to -inf."""
        self._fill(self._matcher, self._bitmask, 0)
        head = scores[:self._vocab]
        self._apply(head[None], self._bitmask.to(scores.device))
        if scores.shape[0] > self._vocab:
            scores[self._vocab:] = float("-inf")

    def accept(self, token: int) -> None:
        """The answer goes on with ``token`` (one :meth:`mask_` allowed)."""
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and allows nothing but the end of the answer."""
        return self._matcher.is_stopped()


class Grammar:
    """A compiled constraint for one tokenizer (``Grammars`` makes them); ``kind`` and ``source``
    say what it was made from."""

    def __init__(self, grammar: str, tokenizer, vocab: int, kind: str, source: str) -> None:
        self._grammar = grammar
        self._tokenizer = tokenizer
        self._vocab = vocab
        self.kind = kind
        self.source = source

    def matcher(self) -> Matcher:
        import llguidance

        return Matcher(llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0), self._vocab)


class Grammars:
    """Compiles grammars for one Hugging Face tokenizer: :meth:`json_object`, :meth:`json_schema`,
    :meth:`regex`, :meth:`lark`, :meth:`choice`. Invalid input raises :class:`GrammarError`."""

    def __init__(self, tokenizer) -> None:
        self.hf_tokenizer = tokenizer
        self._tokenizer = None
        self._lock = threading.Lock()

    def _ll(self):
        """llguidance's view of the tokenizer, made on first use (a few ms to seconds)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer)
            return self._tokenizer

    def _compile(self, grammar: str, kind: str, source: str) -> Grammar:
        import llguidance

        tokenizer = self._ll()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"invalid {kind}: {error}")
        return Grammar(grammar, tokenizer, tokenizer.vocab_size, kind, source)

    def json_schema(self, schema: dict[str, Any]) -> Grammar:
        """Answers that are JSON documents valid against ``schema`` (JSON Schema; unknown keywords
        are an error, as OpenAI's strict mode), on one line (:data:`JSON_LAYOUT`)."""
        import llguidance

        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
        return self._compile(grammar, "JSON schema", json.dumps(schema, sort_keys=True))

    def json_object(self) -> Grammar:
        """Answers that are one JSON object (OpenAI's ``json_object`` mode)."""
        return self.json_schema({"type": "object"})

    def regex(self, pattern: str) -> Grammar:
        """Answers that match ``pattern`` whole."""
        import llguidance

        return self._compile(llguidance.LLMatcher.grammar_from_regex(pattern), "regex", pattern)

    def lark(self, grammar: str) -> Grammar:
        """Answers of a Lark grammar (llguidance's dialect: ``%json{...}`` embeds a JSON schema)."""
        import llguidance

        return self._compile(llguidance.LLMatcher.grammar_from_lark(grammar), "grammar", grammar)

    KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")
    """What :meth:`compile` takes: OpenAI's ``response_format`` types and vLLM's ``guided_*`` fields."""

    def compile(self, kind: str, value: Any = None) -> Grammar:
        """The constraint of one ``kind`` (:data:`KINDS`; ``grammar`` is Lark, ``json_object`` takes
        no value)."""
        if kind == "json_object":
            return self.json_object()
        make = {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.lark, "choice": self.choice}
        if kind not in make:
            raise GrammarError(f"unknown constraint {kind!r}: expected one of {', '.join(self.KINDS)}")
        return make[kind](value)

    def choice(self, options: list[str]) -> Grammar:
        """Answers that are exactly one of ``options``."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("a choice needs one or more non-empty strings")
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        return self.lark(lark)
