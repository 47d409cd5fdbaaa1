"""Exact prefix caching on the embedded SmolLM2-135M-Instruct (slow: loads the real model)."""

from __future__ import annotations

import pytest
import torch

from pckernels.prefix import PrefixCache
from test_prefix import assert_same, run_pair, run_suite

pytestmark = pytest.mark.slow

DOCUMENT = " ".join(
    f"Section {i}: the harbour master records tide height {i * 7 % 31} dm at {i % 12 + 1} o'clock, "
    f"and ships of class {'ABCDE'[i % 5]} may enter only when it exceeds {i % 9 + 10} dm."
    for i in range(16)
)


@pytest.fixture(scope="module")
def smollm():
    from pckernels.integration.embedded import load_model, load_tokenizer

    return load_model(), load_tokenizer()


def test_embedded_suite_short_chats(smollm):
    model, tokenizer = smollm
    cache = PrefixCache(model, tokenizer, block_size=8)  # the short chats are ~45 tokens
    assert cache.reuse_supported, cache.refusal
    assert run_suite(cache, range(3)) == 15


def test_embedded_long_document(smollm):
    model, tokenizer = smollm
    cache = PrefixCache(model, tokenizer, block_size=64)
    question = {"role": "user", "content": "When may a class C ship enter at 5 o'clock?"}
    messages = [{"role": "system", "content": DOCUMENT}, question]
    first_reference, first = run_pair(cache, messages)
    assert len(first.prompt_token_ids) > 600
    repeat_reference = cache.complete(messages, max_new_tokens=8, reuse=False)
    repeat = cache.complete(messages, max_new_tokens=8)
    assert_same(repeat_reference, repeat)
    assert repeat.cached_tokens == len(repeat.prompt_token_ids) and repeat.computed_tokens == 0
    edited = [{"role": "system", "content": DOCUMENT.replace("Section 8:", "Section VIII:")}, question]
    _, edit = run_pair(cache, edited)
    assert 0 < edit.cached_tokens < len(edit.prompt_token_ids) // 2 + 64
    follow_up = messages + [{"role": "assistant", "content": first.text},
                            {"role": "user", "content": "And a class A ship?"}]
    _, turn = run_pair(cache, follow_up)
    assert turn.cached_tokens == len(first.prompt_token_ids) // 64 * 64
    assert torch.equal(first.first_logits, first_reference.first_logits)
