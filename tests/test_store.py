"""Module store through the engine: outputs after eviction, demotion, reload and restart are
bit-identical to a run that never evicted; budgets hold; keys are content-addressed; bad
files are re-encoded; union siblings are prefetched.

Same tiny random Llama, schema and prompts as ``test_engine`` (exactness needs no trained weights).
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from safetensors import SafetensorError

from pckernels.engine import PromptCache
from pckernels.pml import parse_schema
from pckernels.store import BlockKeys
from pckernels.store import disk as disk_module
from pckernels.store.disk import TEMP_PREFIX, list_blocks, read_block, write_block
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

NEW_TOKENS = 4
ORDER = ["everything", "all-of-union-one", "other-member", "nested", "scaffold-all", "scaffold-part",
         "params-short", "nested-some", "scaffold-by-name", "none"]


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer))


@pytest.fixture(scope="module")
def expected(model, tokenizer):
    """Outputs of a cache that never evicts (default budgets, no disk)."""
    pc = PromptCache(model, tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    out = {name: fresh(pc, PROMPTS[name], max_new_tokens=NEW_TOKENS) for name in ORDER}
    assert pc.stats()["device"]["evictions"] == 0
    return out


def fresh(pc: PromptCache, prompt, **options):
    """``pc.generate`` from a clean arena: every block comes from the store (the tier under test),
    and placement — hence rounding — is the same for every engine, so results compare bitwise."""
    pc.evict_resident()
    return pc.generate(prompt, **options)


def assert_same(got, want):
    assert got.token_ids == want.token_ids
    assert torch.equal(got.first_logits, want.first_logits)


def assert_within_budgets(pc: PromptCache) -> None:
    store = pc.store
    assert store.device_tier.nbytes <= store.device_tier.budget
    assert store.host_tier.nbytes <= store.host_tier.budget
    if store.disk is not None:
        assert store.disk.nbytes <= store.disk.budget


def run_all(pc: PromptCache, expected, rounds: int = 2) -> None:
    for r in range(rounds):
        for name in (ORDER if r % 2 == 0 else ORDER[::-1]):
            assert_same(fresh(pc, PROMPTS[name], max_new_tokens=NEW_TOKENS), expected[name])
            assert_within_budgets(pc)


@pytest.fixture(scope="module")
def sizes(model, tokenizer):
    """Byte sizes of the schema's blocks, smallest first."""
    pc = PromptCache(model, tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    store = pc.store
    return sorted(store.device_tier.blocks[k].numel() * store.device_tier.blocks[k].element_size()
                  for k in store.keys())


def test_demotion_and_disk_reload_are_exact(model, tokenizer, expected, sizes, tmp_path):
    pc = PromptCache(model, tokenizer, store_dir=tmp_path, device_budget=2 * sizes[-1],
                     host_budget=2 * sizes[-1], disk_budget=10 * sum(sizes), placement="schema")
    pc.add_schema(SCHEMA)
    assert_within_budgets(pc)
    run_all(pc, expected)
    stats = pc.stats()
    assert stats["device"]["evictions"] > 0 and stats["host"]["evictions"] > 0
    assert stats["host"]["hits"] > 0 and stats["disk"]["loads"] > 0
    assert stats["misses"] == 0 and stats["dropped"] == 0
    assert stats["encodes"] == len(sizes)


def test_eviction_without_disk_reencodes_exactly(model, tokenizer, expected, sizes):
    pc = PromptCache(model, tokenizer, device_budget=sizes[-1], host_budget=sizes[-1], placement="schema")
    pc.add_schema(SCHEMA)
    run_all(pc, expected)
    stats = pc.stats()
    assert stats["dropped"] > 0 and stats["misses"] > 0
    assert stats["encodes"] > len(sizes)
    assert "disk" not in stats


def test_zero_memory_budgets_still_exact(model, tokenizer, expected, tmp_path):
    pc = PromptCache(model, tokenizer, store_dir=tmp_path, device_budget=0, host_budget=0, placement="schema")
    pc.add_schema(SCHEMA)
    run_all(pc, expected, rounds=1)
    assert pc.store.nbytes() == 0
    assert pc.stats()["misses"] == 0


def test_restart_loads_from_disk_instead_of_encoding(model, tokenizer, expected, sizes, tmp_path):
    first = PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema")
    first.add_schema(SCHEMA)
    assert first.stats()["disk"]["writes"] == len(sizes)
    restarted = PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema")
    restarted.add_schema(SCHEMA)
    run_all(restarted, expected, rounds=1)
    stats = restarted.stats()
    assert stats["encodes"] == 0 and stats["disk"]["writes"] == 0
    assert stats["disk"]["loads"] > 0 and stats["disk"]["discarded"] == 0


def _encode_in_child(model, tokenizer, store_dir, barrier) -> None:
    torch.set_num_threads(1)
    barrier.wait()
    pc = PromptCache(model, tokenizer, store_dir=store_dir, placement="schema")
    pc.add_schema(SCHEMA)
    for name in ORDER:
        fresh(pc, PROMPTS[name], max_new_tokens=1)


def test_two_processes_encoding_into_one_directory(model, tokenizer, tmp_path):
    """Two processes encode the same schema into one directory at once; a restart then loads
    every block intact. Every process here runs one thread, so the blocks the children wrote
    are bitwise those this process encodes (MKL's results may depend on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = PromptCache(model, tokenizer, placement="schema")
        reference.add_schema(SCHEMA)
        expected = {name: fresh(reference, PROMPTS[name], max_new_tokens=NEW_TOKENS) for name in ORDER}
        ctx = multiprocessing.get_context("fork")
        barrier = ctx.Barrier(2)
        children = [ctx.Process(target=_encode_in_child, args=(model, tokenizer, tmp_path, barrier))
                    for _ in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join(timeout=120)
            assert child.exitcode == 0
        restarted = PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema")
        restarted.add_schema(SCHEMA)
        run_all(restarted, expected, rounds=1)
    finally:
        torch.set_num_threads(threads)
    stats = restarted.stats()
    assert stats["encodes"] == 0 and stats["disk"]["discarded"] == 0
    assert not list(tmp_path.rglob(".tmp-*"))


def test_other_model_never_receives_these_blocks(model, tokenizer, tmp_path):
    PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema").add_schema(SCHEMA)
    other = PromptCache(tiny_llama(len(tokenizer), seed=1), tokenizer, store_dir=tmp_path, placement="schema")
    other.add_schema(SCHEMA)
    stats = other.stats()
    assert stats["disk"]["loads"] == 0 and stats["encodes"] == stats["disk"]["writes"] > 0
    mine = {k.digest for k in PromptCache(model, tokenizer, placement="schema").store.keys()}
    assert not mine & {k.digest for k in other.store.keys()}


def test_editing_one_module_keeps_the_other_blocks(model, tokenizer, tmp_path):
    edited = SCHEMA.replace("Include local food.", "Include local drinks.")
    assert len(tokenizer.encode("Include local food.")) == len(tokenizer.encode("Include local drinks."))
    first = PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema")
    before = first.add_schema(SCHEMA)
    second = PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema")
    after = second.add_schema(edited)
    assert second.stats()["encodes"] == 1
    changed = [m for m in before.modules if first.block_key(before, m) != second.block_key(after, m)]
    assert changed == [m for m in before.modules if m.endswith("food")]
    want = PromptCache(model, tokenizer, placement="schema")
    want.add_schema(edited)
    prompt = PROMPTS["nested"]
    assert_same(fresh(second, prompt, max_new_tokens=NEW_TOKENS), fresh(want, prompt, max_new_tokens=NEW_TOKENS))


def test_keys_cover_scope_not_names(model, tokenizer):
    pc = PromptCache(model, tokenizer, placement="schema")
    schema = pc.add_schema(SCHEMA)
    renamed = pc.add_schema(SCHEMA.replace('name="guide"', 'name="guide2"'))
    key = pc.block_key
    assert key(schema, "intro") == key(renamed, "intro")
    assert key(schema, "fact-a") != key(schema, "fact-a", "pair")
    food = next(m for m in schema.modules if m.endswith("food"))
    plan_edit = pc.add_schema(SCHEMA.replace('name="guide"', 'name="g3"').replace("Plan a trip", "Plan a tour"))
    assert len(tokenizer.encode("Plan a trip")) == len(tokenizer.encode("Plan a tour"))
    assert key(plan_edit, food) != key(schema, food)
    assert key(plan_edit, "intro") == key(schema, "intro")


def _every_key(keys: BlockKeys, schema) -> list:
    out = [keys(schema, m) for m in schema.modules]
    return out + [keys(schema, m, s.name) for s in schema.scaffolds.values() for m in s.members]


def test_block_key_memo_keeps_one_version_per_schema_name(tokenizer):
    keys = BlockKeys("model", "tokenizer", "cpu")
    versions = [parse_schema(SCHEMA.replace("Include local food.", f"Include local food {i}."), tokenizer)
                for i in range(6)]
    for schema in versions:
        _every_key(keys, schema)
    assert keys.memoized() == {versions[-1].digest: len(_every_key(keys, versions[-1]))}
    first = _every_key(BlockKeys("model", "tokenizer", "cpu"), versions[0])
    assert _every_key(keys, versions[0]) == first and list(keys.memoized()) == [versions[0].digest]


def test_block_key_memo_holds_at_most_memo_schemas_versions(tokenizer):
    keys = BlockKeys("model", "tokenizer", "cpu", memo_schemas=3)
    schemas = [parse_schema(SCHEMA.replace('<schema name="guide">', f'<schema name="guide{i}">'), tokenizer)
               for i in range(8)]
    for schema in schemas:
        _every_key(keys, schema)
        assert len(keys.memoized()) <= 3
    _every_key(keys, schemas[5])
    _every_key(keys, schemas[0])
    assert list(keys.memoized()) == [schemas[7].digest, schemas[5].digest, schemas[0].digest]
    assert _every_key(keys, schemas[1]) == _every_key(BlockKeys("model", "tokenizer", "cpu"), schemas[1])


def test_engine_position_memo_keeps_the_current_schema_versions_only(tokenizer):
    """Re-adding a schema name with new text drops the old version's position tensors."""
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    prompt = PROMPTS["everything"]
    for i in range(5):
        pc.add_schema(SCHEMA.replace("Include local food.", f"Include local food {i}."))
        fresh(pc, prompt, max_new_tokens=1)
    assert list(pc.encoder._positions) == [("", "guide")]
    current = pc.schemas["guide"]
    assert set(pc.encoder._positions[("", "guide")]) <= {pc.block_key(current, m) for m in current.modules} | {
        pc.block_key(current, m, s.name) for s in current.scaffolds.values() for m in s.members}


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "foreign", "garbage", "longer-block", "shorter-block",
                                    "other-dtype"])
def test_bad_block_file_is_discarded_and_reencoded(model, tokenizer, expected, tmp_path, damage, caplog):
    """The ``*-block`` and ``other-dtype`` files are well-formed (right key, valid checksum) but hold
    another block's tensor: more rows (answered wrong before), fewer (an IndexError), or fp16."""
    first = PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema")
    schema = first.add_schema(SCHEMA)
    disk = first.store.disk
    paris = first.block_key(schema, "paris")
    victim = disk.path(paris.digest)
    if damage in ("longer-block", "shorter-block", "other-dtype"):
        source = {"longer-block": "tokyo", "shorter-block": "intro", "other-dtype": "paris"}[damage]
        tensor = first.store.get(first.block_key(schema, source))
        write_block(victim, paris, tensor.half() if damage == "other-dtype" else tensor)
    elif damage == "corrupt":
        data = bytearray(victim.read_bytes())
        data[-10] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif damage == "foreign":
        other = PromptCache(tiny_llama(len(tokenizer), seed=1), tokenizer, store_dir=tmp_path / "other",
                            placement="schema")
        other_schema = other.add_schema(SCHEMA)
        victim.write_bytes(other.store.disk.path(other.block_key(other_schema, "paris").digest).read_bytes())
    else:
        victim.write_bytes(b"not a safetensors file at all")
    restarted = PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema")
    restarted.add_schema(SCHEMA)
    with caplog.at_level("WARNING", logger="pckernels.store.disk"):
        got = fresh(restarted, PROMPTS["all-of-union-one"], max_new_tokens=NEW_TOKENS)
    assert_same(got, expected["all-of-union-one"])
    stats = restarted.stats()
    assert stats["disk"]["discarded"] == 1 and stats["encodes"] == 1
    assert "discarding block file" in caplog.text
    assert restarted.store.disk.read(restarted.block_key(schema, "paris")) is not None


@pytest.mark.parametrize("fault", ["disk-full", "dir-is-file"])
def test_disk_faults_leave_the_engine_answering_from_memory(model, tokenizer, expected, sizes, tmp_path, monkeypatch,
                                                             caplog, fault):
    """The disk fills after two block files (the third write leaves half a file and fails as
    safetensors does), or the store directory is a file: one warning, the disk tier goes off,
    blocks that leave memory are re-encoded, and every answer equals a clean store's."""
    store_dir = tmp_path / "kv"
    if fault == "dir-is-file":
        store_dir.write_text("not a directory")
    else:
        save = disk_module.save_file
        saved = []

        def save_until_full(tensors, filename, metadata=None):
            if len(saved) == 2:
                with open(filename, "wb") as f:
                    f.write(b"\x00" * 100)
                raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
            saved.append(filename)
            save(tensors, filename, metadata=metadata)

        monkeypatch.setattr(disk_module, "save_file", save_until_full)
    with caplog.at_level("WARNING", logger="pckernels.store.disk"):
        pc = PromptCache(model, tokenizer, store_dir=store_dir, device_budget=sizes[-1], host_budget=sizes[-1],
                         placement="schema")
        pc.add_schema(SCHEMA)
        run_all(pc, expected)
    assert caplog.text.count("disk tier off") == 1
    stats = pc.stats()
    assert stats["disk"]["enabled"] is False and stats["disk"]["entries"] == 0
    assert stats["dropped"] > 0 and stats["encodes"] > len(sizes)
    if fault == "dir-is-file":
        assert store_dir.read_text() == "not a directory"
    else:
        assert stats["disk"]["writes"] == 2 and not list(store_dir.rglob(TEMP_PREFIX + "*"))
        files = list_blocks(store_dir)
        assert len(files) == 2 and all(e["status"] == "ok" for e in files)
        assert all(read_block(store_dir.joinpath(e["path"]), e["digest"]) is not None for e in files)


@pytest.mark.parametrize("budget", [{"device_budget": -1}, {"host_budget": "\u22121GiB"}, {"disk_budget": "lots"}])
def test_bad_budget_is_refused_before_the_model_is_touched(tokenizer, tmp_path, budget):
    fresh = tiny_llama(len(tokenizer))
    name = next(iter(budget))
    with pytest.raises(ValueError, match=f"^{name} "):
        PromptCache(fresh, tokenizer, dtype=torch.float64, store_dir=tmp_path / "kv", **budget, placement="schema")
    assert next(fresh.parameters()).dtype == torch.float32 and not (tmp_path / "kv").exists()
    with pytest.raises(ValueError, match=f"^{name} "):
        PromptCache.from_pretrained(str(tmp_path / "no-such-model"), store_dir=tmp_path / "kv", **budget,
                                    placement="schema")


def test_union_siblings_are_prefetched(model, tokenizer, expected, tmp_path):
    PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema").add_schema(SCHEMA)
    pc = PromptCache(model, tokenizer, store_dir=tmp_path, placement="schema")
    schema = pc.add_schema(SCHEMA)
    assert_same(fresh(pc, PROMPTS["all-of-union-one"], max_new_tokens=NEW_TOKENS), expected["all-of-union-one"])
    tokyo = pc.block_key(schema, "tokyo")
    deadline = time.monotonic() + 10
    while pc.stats()["prefetched"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tokyo in pc.store.host_tier
    loads = pc.stats()["disk"]["loads"]
    assert_same(fresh(pc, PROMPTS["other-member"], max_new_tokens=NEW_TOKENS), expected["other-member"])
    stats = pc.stats()
    assert stats["disk"]["loads"] == loads and stats["host"]["hits"] >= 1
    pc.store.close()


def test_stats_report_every_tier(model, tokenizer, tmp_path):
    pc = PromptCache(model, tokenizer, store_dir=tmp_path, device_budget="1MiB", host_budget="2MiB",
                     disk_budget="1GiB", placement="schema")
    pc.add_schema(SCHEMA)
    stats = pc.stats()
    for tier in ("device", "host", "disk"):
        assert {"hits", "entries", "bytes", "budget", "evictions"} <= stats[tier].keys()
    assert stats["device"]["budget"] == 1 << 20 and stats["disk"]["budget"] == 1 << 30
    assert stats["encodes"] > 0 and stats["encode_s"] > 0 and stats["disk"]["writes"] == stats["encodes"]
