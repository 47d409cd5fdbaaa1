"""Exact automatic prefix caching on tiny random models (attention, recurrent and hybrid)."""

from __future__ import annotations

import pytest
import torch

from pckernels.errors import PMLError, PromptTooLongError, UnsupportedModelError
from pckernels.prefix import PrefixCache, encode_prompt
from pckernels.prefix.blocks import BlockStore, CachedEntry, block_keys, prompt_end_key
from pckernels.prefix.states import CacheStates
from pckernels.prefix.testing import tiny_model, tiny_tokenizer

BLOCK = 16
NEW_TOKENS = 5

TOPICS = [
    "tide tables for a small harbour", "the history of the printing press", "how bees choose a new nest",
    "a recipe for sourdough bread", "the rules of chess endgames", "maintenance of a bicycle chain",
    "the water cycle in deserts", "why the sky is blue", "a guide to pruning apple trees",
    "the basics of double-entry bookkeeping",
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def system_prompt(index: int) -> str:
    return f"Doc {index}. You answer questions about {TOPICS[index]}. Be brief, be exact, cite the text."


def assert_same(reference, reused) -> None:
    """Same tokens and bitwise-equal first logits; the reference must not have reused anything."""
    assert reference.cached_tokens == 0 and reference.mode == "uncached"
    assert reused.mode == "prefix"
    assert reused.prompt_token_ids == reference.prompt_token_ids
    assert reused.token_ids == reference.token_ids
    assert torch.equal(reused.first_logits, reference.first_logits)


def run_pair(cache: PrefixCache, prompt, **kwargs):
    reference = cache.complete(prompt, max_new_tokens=NEW_TOKENS, reuse=False, **kwargs)
    reused = cache.complete(prompt, max_new_tokens=NEW_TOKENS, **kwargs)
    assert_same(reference, reused)
    return reference, reused


def require_reuse(cache: PrefixCache, model_type: str) -> None:
    """Skip when the installed transformers makes reuse inexact for this family, after checking
    that the refusal keeps outputs unchanged (both modes then prefill in one pass)."""
    if cache.reuse_supported:
        return
    text = system_prompt(1)
    reference = cache.complete(text, max_new_tokens=NEW_TOKENS, reuse=False)
    refused = cache.complete(text, max_new_tokens=NEW_TOKENS)
    assert refused.mode == "uncached" and refused.cached_tokens == 0
    assert refused.token_ids == reference.token_ids and torch.equal(refused.first_logits, reference.first_logits)
    pytest.skip(f"{model_type}: reuse refused with this transformers version: {cache.refusal}")


def run_suite(cache: PrefixCache, indices) -> int:
    """First pass, repeat, middle edit, second and third chat turn per prompt; returns the cases run."""
    block = cache.block_size
    cases = 0
    for index in indices:
        system = system_prompt(index)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {index}?"}]
        _, first = run_pair(cache, messages)
        assert first.cached_tokens == 0
        _, repeat = run_pair(cache, messages)
        assert repeat.cached_tokens == len(repeat.prompt_token_ids)

        middle = len(system) // 2
        edited_system = system[:middle] + ("#" if system[middle] != "#" else "%") + system[middle + 1:]
        edited = [{"role": "system", "content": edited_system}, messages[1]]
        _, edit = run_pair(cache, edited)
        first_difference = next(i for i, (a, b) in enumerate(zip(first.prompt_token_ids, edit.prompt_token_ids))
                                if a != b)
        assert edit.cached_tokens == first_difference // block * block > 0

        turn = messages
        previous = first
        for turn_number in (2, 3):
            turn = turn + [{"role": "assistant", "content": f"Answer {turn_number - 1}."},
                           {"role": "user", "content": f"Follow-up {turn_number}?"}]
            _, reused = run_pair(cache, turn)
            assert reused.cached_tokens == len(previous.prompt_token_ids) // block * block
            previous = reused
        cases += 5
    return cases


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "lfm2"])
def test_exact_suite_ten_prompts(tokenizer, model_type):
    cache = PrefixCache(tiny_model(model_type, len(tokenizer)), tokenizer, block_size=BLOCK)
    require_reuse(cache, model_type)
    assert run_suite(cache, range(10)) == 50
    stats = cache.stats()
    assert stats["queries"] == 50 and stats["hits"] == 40 and stats["full_hits"] == 10


@pytest.mark.parametrize("model_type", ["mamba2", "falcon_h1"])
def test_exact_suite_more_families(tokenizer, model_type):
    cache = PrefixCache(tiny_model(model_type, len(tokenizer)), tokenizer, block_size=BLOCK)
    require_reuse(cache, model_type)
    assert run_suite(cache, range(3)) == 15


@pytest.mark.parametrize("model_type", ["jamba", "bamba", "granitemoehybrid", "nemotron_h"])
def test_exact_repeat_and_edit_other_hybrids(tokenizer, model_type):
    cache = PrefixCache(tiny_model(model_type, len(tokenizer)), tokenizer, block_size=BLOCK)
    require_reuse(cache, model_type)
    text = system_prompt(0) + " Question?"
    run_pair(cache, text)
    _, repeat = run_pair(cache, text)
    _, edit = run_pair(cache, text[:60] + "!" + text[61:])
    assert repeat.cached_tokens == len(repeat.prompt_token_ids) and edit.cached_tokens == 48


def test_sampling_with_seed_is_identical(tokenizer):
    cache = PrefixCache(tiny_model("qwen3_next", len(tokenizer)), tokenizer, block_size=BLOCK)
    text = system_prompt(4) + " Tell me more."
    for _ in range(2):
        run_pair(cache, text, temperature=0.9, top_p=0.9, seed=7)


def test_chunk_larger_than_block_resumes_on_chunk_boundaries(tokenizer):
    cache = PrefixCache(tiny_model("lfm2", len(tokenizer)), tokenizer, block_size=8, chunk_size=24)
    text = system_prompt(2)
    run_pair(cache, text)
    _, edit = run_pair(cache, text[:70] + "?" + text[71:])
    assert edit.cached_tokens == 48
    _, longer = run_pair(cache, text + " More.")
    assert longer.cached_tokens == len(text) // 24 * 24


def test_eviction_under_small_budget_stays_exact(tokenizer):
    model = tiny_model("qwen3_next", len(tokenizer))
    unlimited = PrefixCache(model, tokenizer, block_size=BLOCK)
    unlimited.complete(system_prompt(0), max_new_tokens=1)
    budget = unlimited.stats()["bytes"] * 2
    cache = PrefixCache(model, tokenizer, block_size=BLOCK, budget_bytes=budget)
    results = []
    for round_number in range(2):
        for index in range(4):
            _, reused = run_pair(cache, system_prompt(index))
            results.append(reused)
            assert cache.stats()["bytes"] <= budget
    stats = cache.stats()
    assert stats["evictions"] > 0 and stats["evicted_tokens"] > 0
    assert stats["queries"] == len(results)
    assert stats["hit_tokens"] == sum(r.cached_tokens for r in results)
    assert stats["computed_tokens"] == sum(r.computed_tokens for r in results)
    assert stats["hits"] == sum(r.cached_tokens > 0 for r in results)
    assert stats["full_hits"] < len(results) - 4  # the budget really dropped repeats


def test_stats_count_only_reused_tokens(tokenizer):
    cache = PrefixCache(tiny_model("llama", len(tokenizer)), tokenizer, block_size=BLOCK)
    short = "tiny"  # shorter than a block: only an exact repeat can reuse it
    cache.complete(short, max_new_tokens=1)
    cache.complete(short + "!", max_new_tokens=1)
    repeat = cache.complete(short, max_new_tokens=1)
    assert repeat.cached_tokens == 4
    stats = cache.stats()
    assert (stats["queries"], stats["hits"], stats["hit_tokens"], stats["computed_tokens"]) == (3, 1, 4, 9)
    cache.complete(short, max_new_tokens=1, reuse=False)
    assert cache.stats()["queries"] == 3


def test_prompt_of_exact_block_multiple_recomputes_last_block(tokenizer):
    cache = PrefixCache(tiny_model("lfm2", len(tokenizer)), tokenizer, block_size=BLOCK)
    ids = list(range(40, 40 + 3 * BLOCK))
    run_pair(cache, ids)
    cache.clear()
    run_pair(cache, ids + [7] * BLOCK)
    _, again = run_pair(cache, ids)  # blocks stored, prompt end not: resume before the last block
    assert again.cached_tokens == 2 * BLOCK


def test_refuses_sliding_window_layers(tokenizer, caplog):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mistral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  sliding_window=8)
    model = AutoModelForCausalLM.from_config(config).eval()
    with caplog.at_level("WARNING"):
        cache = PrefixCache(model, tokenizer, block_size=BLOCK)
    assert not cache.reuse_supported and "SlidingWindow" in cache.refusal
    assert "exact prefix reuse is not available" in caplog.text
    first = cache.complete("hello there", max_new_tokens=3)
    again = cache.complete("hello there", max_new_tokens=3)
    assert again.mode == "uncached" and again.cached_tokens == 0 and again.token_ids == first.token_ids
    with pytest.raises(UnsupportedModelError, match="SlidingWindow"):
        PrefixCache(model, tokenizer, block_size=BLOCK, strict=True)


def test_self_check_refuses_inexact_restore(tokenizer, monkeypatch):
    restore = CacheStates.restore

    def perturbed(self, cache, kv_pieces, states, placed=0):
        restore(self, cache, kv_pieces, states, placed)
        for layer in cache.layers:
            if getattr(layer, "recurrent_states", None) and layer.recurrent_states[0] is not None:
                layer.recurrent_states[0].mul_(1 + 1e-6)

    monkeypatch.setattr(CacheStates, "restore", perturbed)
    cache = PrefixCache(tiny_model("qwen3_next", len(tokenizer)), tokenizer, block_size=BLOCK)
    assert not cache.reuse_supported and "bitwise" in cache.refusal


def short_context_model(family: str, vocab_size: int, positions: int):
    """A tiny random GPT-2 (learned positions: ``wpe`` has ``positions`` rows) or Llama (RoPE)
    whose config allows ``positions`` positions."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2,
                                          n_positions=positions)).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=positions)).eval()


def token_ids(n: int) -> list[int]:
    return [(7 * i) % 200 + 3 for i in range(n)]


@pytest.mark.parametrize("family, limit", [("gpt2", 64), ("llama", 47)])
def test_prompt_must_leave_room_within_max_positions(tokenizer, family, limit):
    """A prompt filling the model's positions is refused with generate()'s error (a ValueError,
    not a PMLError: the prompt is no PML), whether or not reuse is on."""
    cache = PrefixCache(short_context_model(family, len(tokenizer), limit), tokenizer, block_size=BLOCK)
    assert cache.max_positions == limit
    for n in (limit, limit + 1, 1500):
        for reuse in (True, False):
            with pytest.raises(PromptTooLongError, match=f"reaches position {n - 1}, leaving no room to generate "
                                                         f"within the model's {limit} positions") as err:
                cache.complete(token_ids(n), max_new_tokens=1, reuse=reuse)
            assert (err.value.last_position, err.value.limit) == (n - 1, limit)
            assert not isinstance(err.value, PMLError)
    assert cache.stats()["queries"] == 0


@pytest.mark.parametrize("family, limit", [("gpt2", 64), ("llama", 47)])
def test_generation_stops_at_the_last_position(tokenizer, family, limit):
    """Decoding stops with ``"length"`` at the last position: a prompt of ``n`` tokens yields at
    most ``limit - n`` tokens (prompt and answer fit the model's positions), identical with reuse."""
    cache = PrefixCache(short_context_model(family, len(tokenizer), limit), tokenizer, block_size=BLOCK)
    for n in (limit - 1, limit - 20):
        for max_new_tokens in (limit - n + 1, limit - n + 30):
            reference = cache.complete(token_ids(n), max_new_tokens=max_new_tokens, reuse=False)
            reused = cache.complete(token_ids(n), max_new_tokens=max_new_tokens)
            assert_same(reference, reused)
            assert len(reference.token_ids) == limit - n and reference.finish_reason == "length"
    short = cache.complete(token_ids(limit - 20), max_new_tokens=3)
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


def test_encode_prompt_forms(tokenizer):
    ids = encode_prompt(tokenizer, "abc")
    assert ids == tokenizer("abc")["input_ids"]
    assert encode_prompt(tokenizer, ids) == ids
    assert encode_prompt(tokenizer, torch.tensor([ids])) == ids
    chat = encode_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError):
        encode_prompt(tokenizer, "")
    with pytest.raises(TypeError):
        encode_prompt(tokenizer, [1.5])


def test_block_keys_chain_whole_prefix():
    root = b"root"
    a = block_keys(list(range(40)), 8, root)
    b = block_keys(list(range(20)) + [99] + list(range(21, 40)), 8, root)
    assert len(a) == 5 and a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:]))
    assert block_keys([1, 2, 3, 4], 2, root)[1] != block_keys([9, 9, 3, 4], 2, root)[1]
    assert prompt_end_key(a[-1], []) != prompt_end_key(a[-1], [1]) != a[-1]


def _entry(key: bytes, parent, size: int = 100) -> CachedEntry:
    return CachedEntry(key=key, parent=parent, start=0, num_tokens=1, kv=[(torch.zeros(size // 4),)])


def test_block_store_refcounts_and_lru():
    store = BlockStore(budget_bytes=300)
    a = store.insert(_entry(b"a", None))
    b = store.insert(_entry(b"b", a))
    store.release(a)
    assert a.refcount == 1  # held by its child only
    store.release(b)
    c = store.insert(_entry(b"c", None))
    store.release(c)
    assert store.bytes == 300 and len(store) == 3
    store.get(b"a")  # a is recent, but still held by b: b is the oldest evictable leaf
    d = store.insert(_entry(b"d", None))
    assert b"b" not in store and b"a" in store and store.evictions == 1
    store.acquire(d)
    store.release(d)
    store.release(d)
    assert store.bytes <= 300
    with pytest.raises(RuntimeError):
        store.release(d)
    store.clear()
    assert len(store) == 0 and store.bytes == 0


def test_match_holds_what_it_found_until_released(tokenizer):
    """The typed interface: ``match`` finds the longest resumable chain (or the whole prompt) and
    holds it from ``evict``; ``release`` lets it go; ``insert``/``acquire`` hold entries too."""
    cache = PrefixCache(tiny_model("llama", len(tokenizer)), tokenizer, block_size=BLOCK)
    ids = encode_prompt(tokenizer, system_prompt(2) + " " + system_prompt(3))
    miss = cache.match(ids)
    assert miss.chain == [] and miss.held is None and miss.cached_tokens == 0 and miss.end is None
    assert len(miss.keys) == len(ids) // BLOCK and miss.keys == cache.chain_keys(ids)
    cache.prefill(ids)
    stored = cache.stats()["bytes"]
    assert stored > 0

    repeat = cache.match(ids)
    assert repeat.end is not None and repeat.held is repeat.end and repeat.chain[-1] is repeat.end
    longer = cache.match(ids + [5, 6, 7])
    assert longer.end is None and longer.cached_tokens == len(ids) // BLOCK * BLOCK
    assert longer.chain == repeat.chain[:len(longer.chain)]
    assert cache.evict(stored) == 0, "held chains are not evictable"
    cache.release(repeat.held)
    freed = cache.evict(stored)
    assert 0 < freed < stored, "only the prompt end (held by nobody now) goes"
    cache.release(longer.held)
    assert cache.evict(stored) == stored - freed and cache.stats()["entries"] == 0

    cache.prefill(ids)
    found = cache.match(ids)
    again = cache.insert(CachedEntry(key=found.end.key, parent=None, start=0, num_tokens=1, kv=[]))
    assert again is found.end, "a stored name wins, returned held"
    cache.release(found.held)
    assert cache.evict(1 << 40) == 0
    cache.acquire(again)
    cache.release(again)
    assert cache.evict(1 << 40) == 0
    cache.release(again)
    assert cache.evict(1 << 40) == stored and cache.stats()["entries"] == 0


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_reading_chunk_by_chunk_equals_one_prefill(tokenizer, model_type):
    """``begin`` + ``advance`` a chunk at a time is the same read as ``prefill`` (bitwise), and a
    reading closed half-way stores the blocks it completed, holds nothing, and counts nothing."""
    cache = PrefixCache(tiny_model(model_type, len(tokenizer)), tokenizer, block_size=BLOCK)
    ids = encode_prompt(tokenizer, system_prompt(5) + " " + system_prompt(6))
    reference = cache.prefill(ids, reuse=False)
    reading = cache.begin(ids)
    steps = 0
    while not reading.advance(BLOCK):
        steps += 1
    reading.close()
    assert steps == (len(ids) - 1) // BLOCK and torch.equal(reading.logits, reference.logits)
    assert reading.cached_tokens == 0 and cache.stats()["queries"] == 1

    other = encode_prompt(tokenizer, system_prompt(7) + " " + system_prompt(8))
    before = cache.stats()
    half = cache.begin(other)
    half.advance(2 * BLOCK)
    half.close()
    after = cache.stats()
    assert after["entries"] == before["entries"] + 2 and after["queries"] == before["queries"]
    assert cache.evict(1 << 40) == after["bytes"], "a closed reading holds nothing"
    resumed = cache.prefill(other)
    assert torch.equal(resumed.logits, cache.prefill(other, reuse=False).logits)
