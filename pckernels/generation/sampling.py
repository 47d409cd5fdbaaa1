"""How a request's tokens are chosen: its :class:`SamplingParams`, and token selection from logits
(greedy, temperature and nucleus / top-p sampling)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per token (OpenAI's ``top_logprobs`` limit)."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops.

    ``logit_bias``: ``(token, bias)`` pairs added to the logits (bias in [-100, 100]);
    ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]): subtracted, per token, once if it
    was generated / per time it was, as OpenAI defines them; ``logprobs``: record the chosen token's
    log-probability and this many alternatives per token (``None``: none); ``grammar``: a compiled
    constraint (:mod:`pckernels.generation.grammar`) every chosen token must follow.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    grammar: Any = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={self.temperature}, "
                             f"top_p={self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias takes token ids >= 0 with biases between -100 and 100, got "
                                 f"{token}: {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before choosing (bias, penalties or a grammar)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.grammar is not None)

    @classmethod
    def of(cls, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
           stop: str | list[str] | tuple[str, ...] | None = None, seed: int | None = None, *,
           logit_bias: Mapping[int, float] | None = None, presence_penalty: float = 0.0,
           frequency_penalty: float = 0.0, logprobs: int | None = None, grammar: Any = None) -> "SamplingParams":
        """The parameters of the public API's arguments (``stop`` as one string or several,
        ``logit_bias`` as a mapping)."""
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items()))
        return cls(max_new_tokens, temperature, top_p, stops, seed, bias, presence_penalty, frequency_penalty,
                   logprobs, grammar)


def select_token(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """Pick the next token from float ``logits [vocab]``; ``temperature == 0`` is greedy (argmax)."""
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None) -> torch.Generator | None:
    """A seeded CPU generator for reproducible sampling (the same draws on every device; CUDA
    logits are moved to it in ``select_token``), or ``None`` for the global RNG."""
    if seed is None:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen
