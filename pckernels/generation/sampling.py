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
from pckernels.typed import typed_options

MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per token (OpenAI's ``top_logprobs`` limit)."""


SAMPLING_OPTIONS = ("max_new_tokens", "temperature", "top_p", "stop", "seed", "logit_bias", "presence_penalty",
                    "frequency_penalty", "logprobs", "grammar", "n", "top_k", "min_p", "repetition_penalty",
                    "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output")
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

    vLLM's extras, with vLLM's meaning: ``top_k`` (sample among the ``k`` best; ``0`` or ``-1``:
    all); ``min_p`` (in [0, 1]: drop tokens less likely than ``min_p`` times the likeliest, after
    temperature); ``repetition_penalty`` (> 0; 1 is off): a token of the prompt or of the answer so
    far has a positive logit divided by it, a negative one multiplied; ``min_tokens`` (0 to
    ``max_new_tokens``): until this many tokens were chosen, EOS and ``stop_token_ids`` are masked
    out and no stop string ends the answer; ``ignore_eos``: EOS does not end the answer (nor is it
    masked); ``stop_token_ids``: ids that end the answer (the id is kept, its text is not unless
    ``include_stop_str_in_output``); ``skip_special_tokens``: special tokens are left out of the
    text; ``include_stop_str_in_output``: the stop string (or stop id's text) stays in the text.
    Order, as vLLM's sampler: min_tokens mask, logit bias, repetition then frequency and presence
    penalties, grammar mask; greedy takes the argmax of that; sampling divides by the
    temperature, then applies min_p, top_k, top_p.

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
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

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
        if not _is_int(self.top_k) or self.top_k < -1:
            raise OptionError("top_k", self.top_k, "an int: 0 or -1 (off), or at least 1")
        _real(self.min_p, "min_p", "a number in [0, 1]", lambda p: 0.0 <= p <= 1.0)
        _real(self.repetition_penalty, "repetition_penalty", "a number > 0 (1 is off)", lambda r: r > 0)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise OptionError("min_tokens", self.min_tokens, f"an int from 0 to max_new_tokens ({self.max_new_tokens})")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(name, getattr(self, name), "true or false")
        ids = self.stop_token_ids
        ids = (ids,) if _is_int(ids) else ids
        if isinstance(ids, (str, bytes)) or not all(_is_int(t) and t >= 0 for t in (ids or ())):
            raise OptionError("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids or ()))

    @property
    def adjusts(self) -> bool:
        """Whether the logits are changed before choosing (min_tokens mask, bias, penalties or a grammar)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.grammar is not None
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    @classmethod
    def of(cls, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
           stop: str | list[str] | tuple[str, ...] | None = None, seed: int | None = None, *,
           logit_bias: Mapping[int, float] | None = None, presence_penalty: float = 0.0,
           frequency_penalty: float = 0.0, logprobs: int | None = None, grammar: Any = None,
           n: int = 1, **vllm: Any) -> "SamplingParams":
        """The parameters of the public API's arguments (the constructor takes the same forms;
        ``vllm``: the vLLM extras by name)."""
        return cls(max_new_tokens, temperature, top_p, stop, seed, logit_bias or (), presence_penalty,
                   frequency_penalty, logprobs, grammar, n, **vllm)


def sampling_params(params: SamplingParams | None = None, options: Mapping[str, Any] | None = None) -> SamplingParams:
    """The one way the request methods turn what they were given into a :class:`SamplingParams`:
    ``params`` itself, or one built from the loose keyword ``options`` (:data:`SAMPLING_OPTIONS`);
    mistakes are refused as :func:`pckernels.typed.typed_options` says."""
    return typed_options(SamplingParams, params, options, SAMPLING_OPTIONS, arg="params", what="sampling option")


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
                 generator: torch.Generator | None = None, top_k: int = 0, min_p: float = 0.0) -> int:
    """Pick the next token from float ``logits [vocab]``; ``temperature == 0`` is greedy (argmax).
    Sampling divides by ``temperature``, then keeps the tokens at least ``min_p`` times as likely
    as the likeliest (0: all), the ``top_k`` best (ties kept; 0 or -1: all), then the nucleus of
    mass ``top_p`` — vLLM's order."""
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
    if temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = logits.float() / temperature
    if min_p > 0.0 or 0 < top_k < scaled.shape[-1]:
        scaled = filter_logits(scaled, top_k=top_k, min_p=min_p)
    probs = torch.softmax(scaled, dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def filter_logits(scaled: torch.Tensor, *, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """``scaled [vocab]`` (logits already divided by the temperature) with the tokens ``min_p`` and
    then ``top_k`` drop set to ``-inf`` (a new tensor)."""
    if min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < probs.max() * min_p, float("-inf"))
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled


def make_generator(seed: int | None) -> torch.Generator | None:
    """A seeded CPU generator for reproducible sampling (the same draws on every device; CUDA
    logits are moved to it in ``select_token``), or ``None`` for the global RNG."""
    if seed is None:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen
