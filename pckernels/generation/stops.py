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


def first_stop(text: str, stops) -> int | None:
    """Where ``text`` is cut: the index of the earliest stop string in it (``None``: none is).
    The one stop-cut rule; :class:`~pckernels.generation.text.TextStream` applies it to the new
    text of each token (with the tail a stop string may have begun in), for the final answer
    and the stream alike."""
    cut = min((at for at in (text.find(s) for s in stops if s) if at >= 0), default=-1)
    return None if cut < 0 else cut
