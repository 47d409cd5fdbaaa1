"""Small offline tokenizers for the PML tests, built in-process with the ``tokenizers`` library.

``byte_tokenizer`` maps every UTF-8 byte to one token (a byte-level BPE without merges), so a
test can predict token counts exactly: ASCII text of n characters is n tokens. Its special
tokens are single tokens too. ``bpe_tokenizer`` is a byte-level BPE trained on a tiny corpus,
for tests where merges across text boundaries matter.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIALS = [UNK, BOS, EOS] + CHAT_TOKENS

SIMPLE_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Each message is ``<|role|>content<|end|>\\n``; the generation prompt is ``<|assistant|>``."""

DEFAULT_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|system|>You are a bot.<|end|>\n{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Like ``SIMPLE_TEMPLATE`` but injects a default system message (as SmolLM2's does)."""

BOS_TEMPLATE = "{{ bos_token }}" + SIMPLE_TEMPLATE
"""Writes the BOS string before any message (as Llama 3's does)."""


def _wrap(backend: Tokenizer, chat_template: str | None, add_bos: bool) -> PreTrainedTokenizerFast:
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, backend.token_to_id(BOS))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNK, bos_token=BOS,
                                        eos_token=EOS)
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    tokenizer.chat_template = chat_template
    return tokenizer


def byte_tokenizer(chat_template: str | None = SIMPLE_TEMPLATE, *, add_bos: bool = False
                   ) -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte; special tokens first (``<unk>`` is id 0)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(SPECIALS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    return _wrap(backend, chat_template, add_bos)


_CORPUS = [
    "You are a helpful travel agent. Plan a trip to Miami, Paris or Tokyo.",
    "Miami is sunny. Paris is a large city in France. Tokyo is the capital of Japan.",
    "The quick brown fox jumps over the lazy dog. Summarize the document below.",
    "Question: what is the weather like? Answer the question in three days.",
] * 20


@lru_cache(maxsize=None)
def _trained_bpe() -> str:
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    return backend.to_str()


def bpe_tokenizer(chat_template: str | None = SIMPLE_TEMPLATE, *, add_bos: bool = False
                  ) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a tiny corpus (merges, so boundaries matter)."""
    return _wrap(Tokenizer.from_str(_trained_bpe()), chat_template, add_bos)


def ids(tokenizer, text: str) -> tuple[int, ...]:
    """Token ids of ``text`` without special tokens."""
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode(tokenizer, token_ids) -> str:
    return tokenizer.decode(list(token_ids))
