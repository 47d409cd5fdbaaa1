"""A dependency-free word tokenizer for random-weight models (the GPU suite, the smoke test).

One whitespace-separated word is one token, so prompts are sized exactly; ids come from a
stable hash of the word, so any vocabulary size works and no tokenizer file has to travel.
It implements what ``pckernels.pml`` and the engine call on a tokenizer; having no chat
template, role tags expand to the plain ``System: …`` / ``User: …`` format.
"""

from __future__ import annotations

import zlib

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


class WordTokenizer:
    """Words to ids ``3 .. vocab_size - 1`` by CRC32; ``<unk>`` 0 (parameter placeholder),
    ``</s>`` 2 (end of sequence). Decoding joins the known words with spaces."""

    unk_token, bos_token, eos_token, pad_token = "<unk>", None, "</s>", None
    unk_token_id, bos_token_id, eos_token_id, pad_token_id = 0, None, 2, None
    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
        self.vocab_size = vocab_size
        self._words: dict[int, str] = {i: t for i, t in enumerate(SPECIAL_TOKENS)}

    def __len__(self) -> int:
        return self.vocab_size

    def token_id(self, word: str) -> int:
        if word in SPECIAL_TOKENS:
            return SPECIAL_TOKENS.index(word)
        index = len(SPECIAL_TOKENS) + zlib.crc32(word.encode()) % (self.vocab_size - len(SPECIAL_TOKENS))
        self._words.setdefault(index, word)
        return index

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.token_id(word) for word in text.split()]

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **_) -> dict:
        if isinstance(text, str):
            return {"input_ids": self.encode(text)}
        return {"input_ids": [self.encode(t) for t in text]}

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        words = (self._words.get(int(i), "<unk>") for i in token_ids)
        if skip_special_tokens:
            words = (w for w in words if w not in SPECIAL_TOKENS)
        return " ".join(words)

    def get_vocab(self) -> dict[str, int]:
        return {**{t: i for i, t in enumerate(SPECIAL_TOKENS)}, f"<crc32 of {self.vocab_size}>": len(SPECIAL_TOKENS)}
