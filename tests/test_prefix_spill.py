"""Prefix blocks evicted from memory spill into a TieredStore and come back bit for bit."""

from __future__ import annotations

import pytest
import torch

from pckernels.engine import PromptCache
from pckernels.prefix import PrefixCache
from pckernels.prefix.blocks import CachedEntry
from pckernels.prefix.spill import SPILL_SCHEMA, BlockSpill
from pckernels.prefix.testing import tiny_model, tiny_tokenizer
from pckernels.store import TieredStore, list_blocks

BLOCK = 16
NEW_TOKENS = 3
TEXT = "Doc 0. You answer questions about tide tables for a small harbour. Be brief."
OTHER = "Doc 1. You answer questions about the printing press. Cite the text."


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def llama(tokenizer):
    return tiny_model("llama", len(tokenizer))


def block_bytes(model, block: int = BLOCK) -> int:
    """Bytes of one fp32 block's keys and values over all layers."""
    cfg = model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * block * cfg.head_dim * 4


def resumable_tokens(tokenizer, text: str, chunk: int = BLOCK) -> int:
    """Tokens a prefill of ``text`` can resume after: the last chunk boundary before its end."""
    return (len(tokenizer(text)["input_ids"]) - 1) // chunk * chunk


def run_pair(cache: PrefixCache, prompt):
    """The reference (no reuse) and a reusing completion: bitwise-equal first logits, same tokens."""
    reference = cache.complete(prompt, max_new_tokens=NEW_TOKENS, reuse=False)
    reused = cache.complete(prompt, max_new_tokens=NEW_TOKENS)
    assert reference.cached_tokens == 0 and reused.mode == "prefix"
    assert torch.isfinite(reused.first_logits).all()
    assert torch.equal(reused.first_logits, reference.first_logits)
    assert reused.token_ids == reference.token_ids
    return reference, reused


def test_without_spill_an_evicted_prefix_is_recomputed(tokenizer, llama):
    cache = PrefixCache(llama, tokenizer, block_size=BLOCK, budget_bytes=0)
    run_pair(cache, TEXT)
    _, again = run_pair(cache, TEXT)
    stats = cache.stats()
    assert again.cached_tokens == 0 and stats["hit_tokens"] == 0 and stats["evictions"] > 0
    assert not stats["spill"] and stats["spilled_blocks"] == stats["restored_blocks"] == 0


def test_evicted_blocks_come_back_from_the_store(tokenizer, llama):
    store = TieredStore()
    cache = PrefixCache(llama, tokenizer, block_size=BLOCK, budget_bytes=0, spill=store)
    full_blocks = len(tokenizer(TEXT)["input_ids"]) // BLOCK
    _, first = run_pair(cache, TEXT)
    assert first.cached_tokens == 0 and cache.stats()["entries"] == 0
    assert cache.stats()["spilled_blocks"] == len(store) == full_blocks  # prompt ends are not spilled
    assert all(not torch.isnan(block).any() for block in store.device_tier.blocks.values())

    _, again = run_pair(cache, TEXT)
    expected = resumable_tokens(tokenizer, TEXT)
    assert again.cached_tokens == expected > 0
    stats = cache.stats()
    assert stats["restored_blocks"] == expected // BLOCK and stats["restored_tokens"] == expected
    assert stats["hit_tokens"] == expected and stats["hits"] == 1 and stats["full_hits"] == 0
    assert stats["spilled_blocks"] == full_blocks  # blocks the store holds are not written again
    assert store.stats()["device"]["hits"] == expected // BLOCK


def test_memory_chain_continues_in_the_store(tokenizer, llama):
    kept_blocks = 3
    budget = kept_blocks * block_bytes(llama)
    store = TieredStore()
    cache = PrefixCache(llama, tokenizer, block_size=BLOCK, budget_bytes=budget, spill=store)
    full_blocks = len(tokenizer(TEXT)["input_ids"]) // BLOCK
    run_pair(cache, TEXT)
    stats = cache.stats()
    assert stats["entries"] == kept_blocks and stats["spilled_blocks"] == full_blocks - kept_blocks

    _, again = run_pair(cache, TEXT)
    expected = resumable_tokens(tokenizer, TEXT)
    assert again.cached_tokens == expected
    stats = cache.stats()
    assert stats["restored_blocks"] == expected // BLOCK - kept_blocks
    assert stats["hit_tokens"] == expected and stats["bytes"] <= budget


def test_prompts_taking_turns_get_every_block_back(tokenizer, llama):
    texts = [TEXT, OTHER, TEXT.replace("harbour", "marina")]
    budget = 3 * block_bytes(llama)
    cache = PrefixCache(llama, tokenizer, block_size=BLOCK, budget_bytes=budget, spill=TieredStore())
    reused = [run_pair(cache, text)[1] for _ in range(2) for text in texts]
    stats = cache.stats()
    assert [r.cached_tokens for r in reused[len(texts):]] == [resumable_tokens(tokenizer, t) for t in texts]
    assert stats["hit_tokens"] == sum(r.cached_tokens for r in reused) and stats["bytes"] <= budget
    assert stats["spilled_blocks"] > 0 and stats["restored_blocks"] > 0


def test_reuse_resumes_on_chunk_boundaries_only(tokenizer, llama):
    cache = PrefixCache(llama, tokenizer, block_size=8, chunk_size=24, budget_bytes=0, spill=TieredStore())
    run_pair(cache, TEXT)
    _, again = run_pair(cache, TEXT)
    expected = resumable_tokens(tokenizer, TEXT, chunk=24)
    assert again.cached_tokens == expected and cache.stats()["restored_blocks"] == expected // 8


def test_blocks_survive_a_restart_on_disk(tokenizer, llama, tmp_path):
    store = TieredStore(disk_dir=tmp_path)
    cache = PrefixCache(llama, tokenizer, block_size=BLOCK, budget_bytes=0, spill=store)
    run_pair(cache, TEXT)
    spilled = cache.stats()["spilled_blocks"]
    store.close()
    files = list_blocks(tmp_path)
    assert len(files) == spilled > 0
    assert {f["schema"] for f in files} == {SPILL_SCHEMA} and {f["tokens"] for f in files} == {str(BLOCK)}
    assert sorted(f["module"] for f in files) == sorted(f"block@{i * BLOCK}" for i in range(spilled))

    restarted_store = TieredStore(disk_dir=tmp_path)
    restarted = PrefixCache(tiny_model("llama", len(tokenizer)), tokenizer, block_size=BLOCK, spill=restarted_store)
    _, again = run_pair(restarted, TEXT)
    expected = resumable_tokens(tokenizer, TEXT)
    assert again.cached_tokens == expected > 0
    assert restarted.stats()["restored_blocks"] == restarted_store.stats()["disk"]["loads"] == expected // BLOCK

    other_model = PrefixCache(tiny_model("llama", len(tokenizer), seed=1), tokenizer, block_size=BLOCK,
                              spill=TieredStore(disk_dir=tmp_path))
    _, unrelated = run_pair(other_model, TEXT)
    assert unrelated.cached_tokens == 0 and other_model.stats()["restored_blocks"] == 0


def test_a_spilled_file_holding_another_tensor_is_discarded(tokenizer, llama, tmp_path):
    """A well-formed block file (valid checksum) whose tensor is not the block its key names — too
    few rows here — is refused on load, deleted, and the prefix is recomputed exactly."""
    from pathlib import Path

    from pckernels.store import BlockKey
    from pckernels.store.disk import write_block

    store = TieredStore(disk_dir=tmp_path)
    cache = PrefixCache(llama, tokenizer, block_size=BLOCK, budget_bytes=0, spill=store)
    run_pair(cache, TEXT)
    store.close()
    first = next(f for f in list_blocks(tmp_path) if f["module"] == "block@0")
    path = Path(first["path"])
    cfg = llama.config
    wrong = torch.zeros(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, BLOCK - 3, cfg.head_dim)
    write_block(path, BlockKey(first["digest"], schema=SPILL_SCHEMA, module="block@0", tokens=BLOCK), wrong)

    restarted_store = TieredStore(disk_dir=tmp_path)
    restarted = PrefixCache(llama, tokenizer, block_size=BLOCK, spill=restarted_store)
    _, again = run_pair(restarted, TEXT)
    assert again.cached_tokens == 0
    assert restarted_store.stats()["disk"]["discard_reasons"] == {"wrong shape": 1}
    assert not path.exists()


@pytest.mark.parametrize("model_type", ["lfm2", "qwen3_next", "falcon_h1", "mamba2"])
def test_hybrid_blocks_spill_with_their_states_and_survive_a_restart(tokenizer, model_type, tmp_path):
    """A hybrid (or pure SSM) model's evicted blocks go to the store packed with their recurrent
    snapshots, come back bitwise — in memory and from disk after a restart — and a packed block
    that does not fit the model (another layout) is refused and the prefix recomputed exactly."""
    from pckernels.prefix.testing import TINY_CONFIGS

    assert model_type in TINY_CONFIGS
    store = TieredStore(disk_dir=tmp_path)
    cache = PrefixCache(tiny_model(model_type, len(tokenizer)), tokenizer, block_size=BLOCK, budget_bytes=0,
                        spill=store)
    if not cache.reuse_supported:
        pytest.skip(f"{model_type}: reuse refused with this transformers version: {cache.refusal}")
    assert cache.spill is not None and cache.spill.kinds is not None
    run_pair(cache, TEXT)
    _, again = run_pair(cache, TEXT)
    expected = resumable_tokens(tokenizer, TEXT)
    stats = cache.stats()
    assert again.cached_tokens == expected > 0 and stats["restored_blocks"] == expected // BLOCK
    assert stats["spilled_blocks"] == len(tokenizer(TEXT)["input_ids"]) // BLOCK
    store.close()
    files = list_blocks(tmp_path)
    assert files and {f["schema"] for f in files} == {SPILL_SCHEMA}

    restarted = PrefixCache(tiny_model(model_type, len(tokenizer)), tokenizer, block_size=BLOCK,
                            spill=TieredStore(disk_dir=tmp_path))
    _, resumed = run_pair(restarted, TEXT)
    assert resumed.cached_tokens == expected and restarted.stats()["restored_blocks"] == expected // BLOCK

    other = "lfm2" if model_type != "lfm2" else "qwen3_next"
    foreign = PrefixCache(tiny_model(other, len(tokenizer)), tokenizer, block_size=BLOCK,
                          spill=TieredStore(disk_dir=tmp_path))
    _, unrelated = run_pair(foreign, TEXT)
    assert unrelated.cached_tokens == 0 and foreign.stats()["restored_blocks"] == 0


def test_a_packed_block_that_does_not_fit_is_refused(tokenizer):
    """A packed hybrid block whose parts do not fit the model (damaged, or another layout) is never
    restored: the spill reports a miss and the prefix is computed."""
    import logging

    from pckernels.prefix.packing import pack, unpack

    cache = PrefixCache(tiny_model("qwen3_next", len(tokenizer)), tokenizer, block_size=BLOCK, spill=TieredStore())
    ids = tokenizer(TEXT)["input_ids"]
    cache.prefill(ids)
    stored = cache.match(ids + [5])
    first = stored.chain[0]
    blob = pack(first.kv, first.states, torch.device("cpu"))
    kv, states = unpack(blob, cache.states.kinds, BLOCK, torch.device("cpu"))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv, first.kv) if a is not None)
    for bad, kinds, tokens in ((blob[:-3], cache.states.kinds, BLOCK), (blob, cache.states.kinds, BLOCK - 1),
                               (blob, ["kv"] * len(cache.states.kinds), BLOCK), (blob[:5], cache.states.kinds, BLOCK)):
        with pytest.raises(ValueError):
            unpack(bad, kinds, tokens, torch.device("cpu"))
    cache.release(stored.held)
    spill = cache.spill
    key = spill.key(first.key, 0, BLOCK)
    spill.store.put(key, blob[:-3])
    logger = logging.getLogger("pckernels.prefix.spill")
    logger.disabled = True
    try:
        assert spill.get(first.key, None, 0, BLOCK) is None
    finally:
        logger.disabled = False


def test_clear_does_not_spill(tokenizer, llama):
    store = TieredStore()
    cache = PrefixCache(llama, tokenizer, block_size=BLOCK, spill=store)
    run_pair(cache, TEXT)
    cache.clear()
    assert cache.stats()["entries"] == 0 and len(store) == 0


def test_engine_prefix_spills_into_its_store(tokenizer, llama):
    """The engine's prefix cache spills into the engine's store, under keys of its own: it reads
    prompts through the engine's forward into arena rows, whose bits a standalone prefix cache
    (HF's modules, a dynamic cache) does not reproduce."""
    engine = PromptCache(llama, tokenizer)
    prefix = engine.prefix
    assert prefix.spill is not None and prefix.spill.store is engine.store
    standalone = PrefixCache(llama, tokenizer, block_size=BLOCK, spill=TieredStore())
    chain_key = b"\x01" * 16
    ours, theirs = prefix.spill.key(chain_key, 0, BLOCK), standalone.spill.key(chain_key, 0, BLOCK)
    assert ours.digest != theirs.digest and ours.shape == theirs.shape


def test_blocks_of_uneven_layers_are_not_spilled():
    store = TieredStore()
    spill = BlockSpill(store, model_id="m", device=torch.device("cpu"), kv_dtype=torch.float32, num_layers=2)
    uneven = [(torch.zeros(1, 2, BLOCK, 16), torch.zeros(1, 2, BLOCK, 8))] * 2
    assert not spill.put(CachedEntry(key=b"k" * 16, parent=None, start=0, num_tokens=BLOCK, kv=uneven))
    even = [(torch.zeros(1, 2, BLOCK, 16), torch.ones(1, 2, BLOCK, 16))] * 2
    assert spill.put(CachedEntry(key=b"k" * 16, parent=None, start=0, num_tokens=BLOCK, kv=even))
    restored = spill.get(b"k" * 16, None, 0, BLOCK)
    assert len(store) == 1 and spill.spilled_blocks == 1 and spill.restored_tokens == BLOCK
    assert all(torch.equal(k, a) and torch.equal(v, b) for (k, v), (a, b) in zip(restored.kv, even))
