"""Token selection from logits: greedy, temperature and nucleus (top-p) sampling."""

from __future__ import annotations

import torch


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


class StopChecker:
    """Stops generation at EOS ids or when the decoded text ends with a stop string."""

    def __init__(self, tokenizer, stop: str | list[str] | None, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.eos_ids = eos_ids

    def check(self, token_ids: list[int]) -> tuple[bool, str]:
        """``(done, reason)`` after appending ``token_ids[-1]``; reason is ``"eos"`` or ``"stop"``."""
        if token_ids and token_ids[-1] in self.eos_ids:
            return True, "eos"
        if self.stop:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            if any(s and s in text for s in self.stop):
                return True, "stop"
        return False, ""

    def trim(self, text: str) -> str:
        """Cut ``text`` at the first stop string."""
        cut = min((text.find(s) for s in self.stop if s and s in text), default=-1)
        return text if cut < 0 else text[:cut]
