"""When a generation ends: end-of-sequence ids and stop strings."""

from __future__ import annotations


def eos_token_ids(model, tokenizer) -> set[int]:
    """The ids that end a generation: the tokenizer's end-of-sequence token and the model's
    ``generation_config.eos_token_id`` (one id or several)."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(t) for t in source)
    return ids


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
