"""How a request's tokens are chosen: its :class:`SamplingParams`, and token selection from logits
(greedy, temperature and nucleus / top-p sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got temperature={self.temperature}, "
                             f"top_p={self.top_p}")

    @classmethod
    def of(cls, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
           stop: str | list[str] | tuple[str, ...] | None = None, seed: int | None = None) -> "SamplingParams":
        """The parameters of the public API's arguments (``stop`` as one string or several)."""
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        return cls(max_new_tokens, temperature, top_p, stops, seed)


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
