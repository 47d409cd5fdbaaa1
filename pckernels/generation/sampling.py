"""How a request's tokens are chosen: its :class:`SamplingParams`, and token selection from logits
(greedy, temperature and nucleus / top-p sampling)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pckernels.errors import OptionError

MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per token (OpenAI's ``top_logprobs`` limit)."""


SAMPLING_OPTIONS = ("max_new_tokens", "temperature", "top_p", "stop", "seed", "logit_bias", "presence_penalty",
                    "frequency_penalty", "logprobs", "grammar", "n")
"""The keyword arguments the request methods take for a :class:`SamplingParams` (its fields)."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops: one object, checked when it is made.

    ``max_new_tokens`` (>= 1); ``temperature`` (>= 0; 0 is greedy) and ``top_p`` (in (0, 1]);
    ``stop``: strings that end the answer (one string or several; kept as a tuple); ``seed``: the
    request's own RNG (``None``: the global one); ``logit_bias``: ``{token: bias}`` or
    ``(token, bias)`` pairs added to the logits (bias in [-100, 100]; kept as sorted pairs);
    ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]): subtracted, per token, once if it
    was generated / per time it was, as OpenAI defines them; ``logprobs``: record the chosen token's
    log-probability and this many alternatives per token (``None``: none); ``grammar``: a compiled
    constraint (:mod:`pckernels.generation.grammar`) every chosen token must follow; ``n``:
    answers from one reading of the prompt (a sampled answer ``i`` uses ``seed + i``).

    A bad value raises :class:`~pckernels.errors.OptionError` (a ``ValueError`` naming the
    field; the server answers it with a 400) before anything is queued.
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
    n: int = 1

    def __post_init__(self) -> None:
        _count(self.max_new_tokens, "max_new_tokens", 1)
        _real(self.temperature, "temperature", "a finite number >= 0", lambda t: t >= 0)
        _real(self.top_p, "top_p", "a number in (0, 1]", lambda p: 0.0 < p <= 1.0)
        object.__setattr__(self, "stop", _stops(self.stop))
        if self.seed is not None and not _is_int(self.seed):
            raise OptionError("seed", self.seed, "an int or None")
        for name in ("presence_penalty", "frequency_penalty"):
            _real(getattr(self, name), name, "a number between -2 and 2", lambda x: -2.0 <= x <= 2.0)
        object.__setattr__(self, "logit_bias", _bias(self.logit_bias))
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise OptionError("logprobs", self.logprobs, f"between 0 and {MAX_LOGPROBS} (or None)")
        _count(self.n, "n", 1)

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before choosing (bias, penalties or a grammar)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.grammar is not None)

    @classmethod
    def of(cls, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
           stop: str | list[str] | tuple[str, ...] | None = None, seed: int | None = None, *,
           logit_bias: Mapping[int, float] | None = None, presence_penalty: float = 0.0,
           frequency_penalty: float = 0.0, logprobs: int | None = None, grammar: Any = None,
           n: int = 1) -> "SamplingParams":
        """The parameters of the public API's arguments (the constructor takes the same forms)."""
        return cls(max_new_tokens, temperature, top_p, stop, seed, logit_bias or (), presence_penalty,
                   frequency_penalty, logprobs, grammar, n)


def sampling_params(params: SamplingParams | None = None, options: Mapping[str, Any] | None = None) -> SamplingParams:
    """The one way the request methods turn what they were given into a :class:`SamplingParams`:
    ``params`` itself, or one built from the loose keyword ``options`` (:data:`SAMPLING_OPTIONS`).
    Both at once, a ``params`` that is no ``SamplingParams`` or an unknown keyword is a ``TypeError``."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(SAMPLING_OPTIONS))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))}: sampling options are "
                        f"{', '.join(SAMPLING_OPTIONS)}")
    if params is None:
        return SamplingParams(**options)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if options:
        raise TypeError(f"give either params or the sampling keywords, not both (got params and "
                        f"{', '.join(sorted(options))}); dataclasses.replace(params, ...) changes a field")
    return params


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _count(value: Any, name: str, least: int) -> None:
    if not _is_int(value) or value < least:
        raise OptionError(name, value, f"an int >= {least}", message=f"{name} must be >= {least}, got {value!r}")


def _real(value: Any, name: str, expected: str, ok) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise OptionError(name, value, expected)


def _stops(stop: Any) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    for item in stops:
        if not isinstance(item, str):
            raise OptionError("stop", stop, "a string or a list of strings")
    return stops


def _bias(bias: Any) -> tuple[tuple[int, float], ...]:
    pairs = bias.items() if isinstance(bias, Mapping) else bias or ()
    out = []
    for pair in pairs:
        try:
            token, value = pair
            token, value = int(token), float(value)
        except (TypeError, ValueError):
            raise OptionError("logit_bias", pair, "token id -> bias pairs",
                              message=f"logit_bias takes token ids with biases, got {pair!r}") from None
        if token < 0 or not -100.0 <= value <= 100.0:
            raise OptionError("logit_bias", (token, value), "token ids >= 0 with biases between -100 and 100",
                              message=f"logit_bias takes token ids >= 0 with biases between -100 and 100, got "
                                      f"{token}: {value}")
        out.append((token, value))
    return tuple(sorted(out))


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
