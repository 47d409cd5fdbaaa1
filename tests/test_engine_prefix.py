"""The engine's exact prefix reuse (``pckernels.engine.prefix_rows``): prompts read into arena rows.

A hit places the stored blocks into the request's rows and computes the rest there; its first
logits and greedy tokens are bitwise those of ``reuse=False`` — with the blocks at other arena
rows than where they were computed, with free rows poisoned, with blocks spilled to the store
and read back, when no contiguous run is free (the prompt is read privately and moved), for the
native forward and HF's modules alike.
"""

from __future__ import annotations

import pytest
import torch

from family_models import BY_NAME
from pckernels.engine import PromptCache
from test_families import hf_forward, tokenizer  # noqa: F401  (fixture)

BLOCK = 16
NEW = 4


def doc(tokenizer, seed: int, tokens: int = 90) -> list[int]:  # noqa: F811
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, len(tokenizer) - 100, (tokens,), generator=g).tolist()


def engine(tokenizer, *, native: bool = True, **options) -> PromptCache:  # noqa: F811
    model = BY_NAME["llama"].build(len(tokenizer))
    if native:
        return PromptCache(model, tokenizer, prefix_block_size=BLOCK, **options)
    with hf_forward():
        return PromptCache(model, tokenizer, prefix_block_size=BLOCK, **options)


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits)


@pytest.mark.parametrize("native", [True, False])
def test_a_hit_is_bitwise_the_uncached_read(tokenizer, native):  # noqa: F811
    pc = engine(tokenizer, native=native)
    assert (pc.adapter.native is not None) == native
    base = doc(tokenizer, 1)
    first, second = base + doc(tokenizer, 2, 7), base + doc(tokenizer, 3, 5)
    fresh = pc.complete(second, max_new_tokens=NEW, reuse=False)
    pc.complete(first, max_new_tokens=NEW)
    hit = pc.complete(second, max_new_tokens=NEW)
    assert hit.cached_tokens == len(base) // BLOCK * BLOCK
    assert hit.computed_tokens == len(second) - hit.cached_tokens
    assert same(hit, fresh)
    repeat = pc.complete(second, max_new_tokens=NEW)
    assert repeat.cached_tokens == len(second) and same(repeat, fresh)


def test_hits_survive_other_rows_poison_and_batches(tokenizer):  # noqa: F811
    pc = engine(tokenizer)
    base = doc(tokenizer, 4, 70)
    prompts = [base + doc(tokenizer, 10 + i, 3 + i) for i in range(4)]
    fresh = [pc.complete(p, max_new_tokens=NEW, reuse=False) for p in prompts]
    pc.complete(prompts[0], max_new_tokens=NEW)
    with pc.model_lock:
        pc.scheduler.arena.poison_()
        handles = [pc.submit(pc.complete_request(p, max_new_tokens=NEW)) for p in prompts[1:]]
    for handle, want in zip(handles, fresh[1:]):
        got = handle.result(timeout=60)
        assert got.cached_tokens == 64
        assert torch.equal(got.first_logits, want.first_logits)
        assert got.token_ids[0] == want.token_ids[0]


def test_without_a_free_run_the_prompt_is_read_privately_and_moved(tokenizer, monkeypatch):  # noqa: F811
    pc = engine(tokenizer)
    base = doc(tokenizer, 5)
    prompt = base + doc(tokenizer, 6, 9)
    fresh = pc.complete(prompt, max_new_tokens=NEW, reuse=False)
    pc.complete(base + doc(tokenizer, 7, 4), max_new_tokens=NEW)
    monkeypatch.setattr(pc.scheduler.arena, "allocate_run", lambda n: None)
    monkeypatch.setattr(pc.scheduler.arena, "allocate_at", lambda start, n: None)
    hit = pc.complete(prompt, max_new_tokens=NEW)
    assert pc.stats()["engine"]["prefix_rows_moved"] == 1
    assert hit.cached_tokens > 0 and same(hit, fresh)


def test_rows_left_by_the_last_reader_are_reused_in_place(tokenizer):  # noqa: F811
    """A request reading the blocks an earlier one left in free rows starts its run there and copies
    nothing; once those rows are handed out (here: poisoned) the blocks are placed again."""
    pc = engine(tokenizer)
    base = doc(tokenizer, 12)
    prompts = [base + doc(tokenizer, 20 + i, 5 + i) for i in range(3)]
    fresh = [pc.complete(p, max_new_tokens=NEW, reuse=False) for p in prompts]
    pc.complete(prompts[0], max_new_tokens=NEW)
    counters = pc.scheduler.counters
    before = counters["prefix_tokens_in_place"]
    hit = pc.complete(prompts[1], max_new_tokens=NEW)
    assert counters["prefix_tokens_in_place"] - before == len(base) // BLOCK * BLOCK
    assert same(hit, fresh[1])
    with pc.model_lock:
        pc.scheduler.arena.poison_()
    before = counters["prefix_tokens_in_place"]
    hit = pc.complete(prompts[2], max_new_tokens=NEW)
    assert counters["prefix_tokens_in_place"] == before and hit.cached_tokens > 0
    assert same(hit, fresh[2])
    other = doc(tokenizer, 30, 3 * BLOCK)
    pc.complete(other, max_new_tokens=NEW)
    pc.complete(prompts[0], max_new_tokens=NEW, reuse=False)
    hit = pc.complete(prompts[1], max_new_tokens=NEW)
    assert same(hit, fresh[1]), "rows another request wrote were taken for the blocks they held before"


@pytest.mark.parametrize("resume", ["block", "token"])
def test_spilled_blocks_come_back_bitwise(tokenizer, resume):  # noqa: F811
    """Blocks evicted to the store are read back for a hit: every block short of the prompt's end
    with token resumption (its 256-token chunk notwithstanding), bitwise reuse off with block
    resumption (to rounding with token)."""
    pc = engine(tokenizer, prefix_resume=resume)
    base = doc(tokenizer, 8)
    prompt = base + doc(tokenizer, 9, 6)
    fresh = pc.complete(prompt, max_new_tokens=NEW, reuse=False)
    pc.complete(base + doc(tokenizer, 11, 3), max_new_tokens=NEW)
    prefix = pc.prefix
    prefix.evict(prefix.stats()["bytes"])
    assert prefix.stats()["entries"] == 0 and prefix.stats()["spilled_blocks"] > 0
    hit = pc.complete(prompt, max_new_tokens=NEW)
    assert prefix.stats()["restored_blocks"] == len(base) // BLOCK
    assert hit.cached_tokens == len(base) // BLOCK * BLOCK
    if resume == "block":
        assert same(hit, fresh)
    else:
        assert hit.token_ids == fresh.token_ids
        assert torch.allclose(hit.first_logits, fresh.first_logits, atol=1e-4, rtol=0)


def test_engine_blocks_are_not_a_standalone_prefix_cache_s(tokenizer):  # noqa: F811
    """Chains are rooted in the engine's numerics: another forward's blocks never match."""
    native, hf = engine(tokenizer), engine(tokenizer, native=False)
    assert native.prefix._root != hf.prefix._root


@pytest.mark.parametrize("native", [True, False])
def test_token_granular_resumption_starts_at_the_first_new_token(tokenizer, native):  # noqa: F811
    """prefix_resume="token": a new question after a cached document whose length is no multiple
    of the block resumes after the document's last token (inside the stored prompt end), equals
    reuse off to rounding (same greedy tokens), stores what it computed (its repeat is a whole
    hit with its own first logits), and leaves the arena's remembered rows right for the next hits."""
    pc = engine(tokenizer, native=native, prefix_resume="token")
    base = doc(tokenizer, 21, 75)
    first, second, third = (base + doc(tokenizer, seed, 9) for seed in (22, 23, 24))
    fresh = [pc.complete(p, max_new_tokens=NEW, reuse=False) for p in (second, third)]
    pc.complete(first, max_new_tokens=NEW)
    stored = pc.prefix.stats()["entries"]
    hit = pc.complete(second, max_new_tokens=NEW)
    assert hit.cached_tokens >= len(base) > len(base) // BLOCK * BLOCK
    assert hit.token_ids == fresh[0].token_ids
    assert torch.allclose(hit.first_logits, fresh[0].first_logits, atol=1e-4, rtol=0)
    assert pc.prefix.stats()["partial_tokens"] == hit.cached_tokens - len(base) // BLOCK * BLOCK
    assert pc.prefix.stats()["entries"] > stored, "a token-resumed read stores what it computed"
    repeat = pc.complete(second, max_new_tokens=NEW)
    assert repeat.cached_tokens == len(second) and same(repeat, hit)
    again = pc.complete(third, max_new_tokens=NEW)
    assert again.cached_tokens >= len(base) and again.token_ids == fresh[1].token_ids
    block_mode = engine(tokenizer, native=native)
    block_mode.complete(first, max_new_tokens=NEW)
    assert block_mode.complete(second, max_new_tokens=NEW).cached_tokens == len(base) // BLOCK * BLOCK


def test_token_granular_resumption_needs_an_attention_only_model():
    from pckernels.prefix.testing import tiny_model, tiny_tokenizer

    byte_tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match="attention-only"):
        PromptCache(tiny_model("lfm2", len(byte_tokenizer)), byte_tokenizer, prefix_resume="token")
    with pytest.raises(ValueError, match="prefix_resume"):
        PromptCache(tiny_model("llama", len(byte_tokenizer)), byte_tokenizer, prefix_resume="chunk")


def counting_forwards(pc: PromptCache) -> list[int]:
    """Patch ``pc``'s prefix cache to record the tokens of each prompt forward it runs."""
    prefix, sizes = pc.prefix, []
    forward = prefix.forward_chunk

    def counted(cache, input_ids, first_position):
        sizes.append(input_ids.shape[1])
        return forward(cache, input_ids, first_position)

    prefix.forward_chunk = counted
    return sizes


def test_a_chunk_of_several_blocks_resumes_only_at_its_boundaries_bitwise(tokenizer):  # noqa: F811
    """``prefix_chunk=3 * BLOCK`` with block resumption: a prompt is read in 48-token forwards, a hit
    resumes at the last 48-token boundary it has (not at every 16-token block) and is bitwise
    reuse off."""
    pc = engine(tokenizer, prefix_chunk=3 * BLOCK)
    base = doc(tokenizer, 31, 100)
    first, second = base + doc(tokenizer, 32, 11), base + doc(tokenizer, 33, 6)
    fresh = pc.complete(second, max_new_tokens=NEW, reuse=False)
    sizes = counting_forwards(pc)
    pc.complete(first, max_new_tokens=NEW)
    assert sizes == [48, 48, 15]
    hit = pc.complete(second, max_new_tokens=NEW)
    assert hit.cached_tokens == 96 and same(hit, fresh)
    assert sizes[3:] == [len(second) - 96]


def test_token_resumption_reads_in_large_chunks_and_chats_hit_their_last_turn(tokenizer):  # noqa: F811
    """``prefix_resume="token"`` reads a prompt in chunks of 256 tokens by default whatever the
    block (one forward here, where block resumption reads 16-token ones), and each turn of a chat
    resumes after the whole previous turn — stored though that turn was itself a resumed read —
    with the same greedy tokens as reuse off."""
    pc = engine(tokenizer, prefix_resume="token")
    assert pc.prefix.chunk_size == 256 and pc.prefix.block_size == BLOCK
    turns = [doc(tokenizer, 41, 77)]
    for seed in (42, 43, 44):
        turns.append(turns[-1] + doc(tokenizer, seed, 13))
    fresh = [pc.complete(t, max_new_tokens=NEW, reuse=False) for t in turns]
    sizes = counting_forwards(pc)
    for i, turn in enumerate(turns):
        got = pc.complete(turn, max_new_tokens=NEW)
        assert got.token_ids == fresh[i].token_ids
        assert torch.allclose(got.first_logits, fresh[i].first_logits, atol=1e-4, rtol=0)
        assert got.cached_tokens == (len(turns[i - 1]) if i else 0)
    assert sizes == [77, 13, 13, 13]
    block_mode = engine(tokenizer)
    block_sizes = counting_forwards(block_mode)
    block_mode.complete(turns[0], max_new_tokens=NEW)
    assert block_sizes == [16, 16, 16, 16, 13]


def test_rows_of_a_block_another_read_stored_first_are_not_taken_for_it(tokenizer):  # noqa: F811
    """Token resumption stores what it computes, so two reads of one new prompt race to store its
    blocks: the second read's rows are not the stored bits (in general: its chunks may be cut
    elsewhere), and its ``exact_tokens`` says so; block resumption's reads are bitwise equal."""
    for resume, exact in (("token", 0), ("block", None)):
        pc = engine(tokenizer, prefix_resume=resume)
        prompt = doc(tokenizer, 51, 70)
        with pc.model_lock:
            first, second = pc.prefix.begin(prompt), pc.prefix.begin(prompt)
            try:
                first.advance()
                second.advance()
                assert first.prefill().exact_tokens == len(prompt)
                assert second.prefill().exact_tokens == (len(prompt) if exact is None else exact)
            finally:
                first.close()
                second.close()
