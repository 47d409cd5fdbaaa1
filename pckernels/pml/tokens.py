"""What the PML layer needs from a tokenizer: batch encoding, BOS, placeholder, identity.

Any Hugging Face tokenizer works (``tokenizer(texts, add_special_tokens=False)`` must return
``{"input_ids": [[...], ...]}``); fast (Rust) tokenizers encode batches in parallel.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from typing import Any, Callable, Generic, Sequence, TypeVar

from pckernels.errors import PMLError

log = logging.getLogger(__name__)

T = TypeVar("T")


class PerTokenizer(Generic[T]):
    """Values computed once per tokenizer and chat template, weakly keyed (a tokenizer that
    cannot be weakly referenced or hashed gets a fresh value every time)."""

    def __init__(self) -> None:
        self._values: weakref.WeakKeyDictionary[Any, tuple[str | None, T]] = weakref.WeakKeyDictionary()

    def get(self, tokenizer: Any, template: str | None, compute: Callable[[], T]) -> T:
        """The value kept for ``tokenizer`` with ``template``, else ``compute()`` (then kept)."""
        try:
            cached = self._values.get(tokenizer)
        except TypeError:
            cached = None
        if cached is not None and cached[0] == template:
            return cached[1]
        value = compute()
        try:
            self._values[tokenizer] = (template, value)
        except TypeError:
            pass
        return value


_FINGERPRINTS: PerTokenizer[str] = PerTokenizer()


def encode_batch(tokenizer: Any, texts: Sequence[str]) -> list[tuple[int, ...]]:
    """Token ids of each text, without special tokens (duplicates encoded once)."""
    if not texts:
        return []
    unique = list(dict.fromkeys(texts))
    try:
        encoded = tokenizer(unique, add_special_tokens=False)["input_ids"]
    except Exception as exc:  # a tokenizer failure on user text is a rejection of that text
        raise PMLError(f"the tokenizer could not encode the PML text: {exc}") from exc
    by_text = {text: tuple(int(t) for t in ids) for text, ids in zip(unique, encoded)}
    return [by_text[text] for text in texts]


def special_prefix(tokenizer: Any) -> tuple[int, ...]:
    """Tokens the tokenizer puts before any text by default (typically BOS), else ``()``."""
    with_special = list(tokenizer("x")["input_ids"])
    without = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    if not without:
        return ()
    for start in range(len(with_special) - len(without) + 1):
        if with_special[start:start + len(without)] == without:
            return tuple(int(t) for t in with_special[:start])
    log.warning("could not tell which special tokens %s adds by default; assuming none",
                type(tokenizer).__name__)
    return ()


def placeholder_token_id(tokenizer: Any) -> int:
    """The parameter placeholder: the unk token, else pad, else eos, else id 0."""
    for attribute in ("unk_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attribute, None)
        if isinstance(value, int):
            return value
    log.warning("%s has no unk, pad or eos token; parameter slots use token id 0",
                type(tokenizer).__name__)
    return 0


def fingerprint(tokenizer: Any) -> str:
    """A stable identity of the tokenizer's vocabulary, rules and chat template."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        template = None
    return _FINGERPRINTS.get(tokenizer, template, lambda: _fingerprint(tokenizer, template))


def _fingerprint(tokenizer: Any, template: str | None) -> str:
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        digest.update(backend.to_str().encode())
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        for token, index in sorted(vocab.items(), key=lambda item: item[1]):
            digest.update(f"{index}:{token}\n".encode())
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        digest.update(f"{name}={getattr(tokenizer, name, None)!r}\n".encode())
    digest.update((template or "").encode())
    return digest.hexdigest()
