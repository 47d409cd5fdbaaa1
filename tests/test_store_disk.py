"""Module store without a model: block files (integrity, atomicity, concurrent writers), eviction
policies, and budgets under random operation sequences."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random

import pytest
import torch
from safetensors import SafetensorError

from pckernels.store import (BlockFileError, BlockKey, CostModel, DiskTier, GreedyDualSizePolicy, LRUPolicy, TieredStore,
                             parse_size)
from pckernels.store import disk as disk_module
from pckernels.store.disk import TEMP_PREFIX, list_blocks, read_block, write_block

SHAPE = (2, 2, 1, 8, 4)


def key(i: int) -> BlockKey:
    return BlockKey(f"{i:064x}", model="m", schema="s", module=f"mod{i}", tokens=8)


def block(i: int, n: int = 8, dtype=torch.float32) -> torch.Tensor:
    """``[2, 2, 1, n, 4]`` filled with values that identify ``i``."""
    return (torch.arange(2 * 2 * n * 4, dtype=torch.float32).reshape(2, 2, 1, n, 4) + 1000 * i).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(tmp_path, dtype):
    path = tmp_path / "b.safetensors"
    write_block(path, key(1), block(1, dtype=dtype))
    got = read_block(path, key(1).digest)
    assert got.dtype == dtype and torch.equal(got, block(1, dtype=dtype))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]


def test_empty_block_round_trips(tmp_path):
    empty = torch.zeros(2, 2, 1, 0, 4)
    write_block(tmp_path / "e.safetensors", key(2), empty)
    assert read_block(tmp_path / "e.safetensors", key(2).digest).shape == empty.shape


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b[:8], "truncated"),
    (lambda b: b[:-4] + bytes(x ^ 0x55 for x in b[-4:]), "checksum mismatch"),
    (lambda b: b"\x10" + b[1:], "corrupt header"),
    (lambda b: b"", "truncated header"),
])
def test_damaged_files_are_refused(tmp_path, damage, reason):
    path = tmp_path / "b.safetensors"
    write_block(path, key(1), block(1))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BlockFileError, match=reason):
        read_block(path, key(1).digest)


def test_file_of_another_key_is_foreign(tmp_path):
    path = tmp_path / "b.safetensors"
    write_block(path, key(1), block(1))
    with pytest.raises(BlockFileError, match="foreign"):
        read_block(path, key(2).digest)


def test_disk_tier_discards_and_deletes_bad_files(tmp_path, caplog):
    disk = DiskTier(tmp_path, budget=1 << 20)
    disk.write(key(1), block(1))
    path = disk.path(key(1).digest)
    path.write_bytes(path.read_bytes()[:-7])
    with caplog.at_level("WARNING"):
        assert disk.read(key(1)) is None
    assert not path.exists() and key(1) not in disk and disk.nbytes == 0
    assert disk.stats.discarded == 1 and "truncated" in caplog.text


@pytest.mark.parametrize("stored, reason", [
    (block(1, n=7), "wrong shape"),
    (block(1, n=9), "wrong shape"),
    (block(1).reshape(2, 2, 2, 4, 4), "wrong shape"),
    (block(1)[0], "wrong shape"),
    (block(1, dtype=torch.bfloat16), "wrong dtype"),
])
def test_well_formed_file_of_another_block_is_discarded(tmp_path, caplog, stored, reason):
    """Right key and a valid checksum, but not the tensor the key names: discarded, never used."""
    expected = BlockKey(key(1).digest, module="mod1", tokens=8, shape=SHAPE, dtype=torch.float32)
    store = TieredStore("cpu", disk_dir=tmp_path)
    path = store.disk.path(expected.digest)
    write_block(path, expected, stored)
    assert torch.equal(read_block(path, expected.digest), stored)
    with caplog.at_level("WARNING", logger="pckernels.store.disk"):
        assert store.get(expected) is None
    assert not path.exists() and expected not in store
    stats = store.stats()
    assert stats["misses"] == 1 and stats["disk"]["discarded"] == 1 and stats["disk"]["discard_reasons"] == {reason: 1}
    assert reason in caplog.text and "discarding block file" in caplog.text


def test_expected_shape_may_leave_dimensions_open(tmp_path):
    open_key = BlockKey(key(1).digest, shape=(2, 2, None, 8, None), dtype=torch.float32)
    disk = DiskTier(tmp_path, budget=1 << 20)
    disk.write(open_key, block(1))
    assert torch.equal(disk.read(open_key), block(1))
    with pytest.raises(BlockFileError, match="wrong shape"):
        read_block(disk.path(open_key.digest), open_key.digest, shape=(2, 2, None, 9, None))


@contextlib.contextmanager
def disk_full(how: str, monkeypatch):
    """Writes fail as on a full disk: for real (``RLIMIT_FSIZE``, so safetensors itself raises
    "File too large"), or by a save that leaves half a file and raises what safetensors raises."""
    if how == "rlimit":
        resource = pytest.importorskip("resource")
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, old[1]))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
        return

    def save_half(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(disk_module, "save_file", save_half)
    yield


def block_files(root) -> list:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.parametrize("how", ["rlimit", "patched"])
def test_disk_full_drops_the_write_and_turns_the_tier_off(tmp_path, monkeypatch, caplog, how):
    store = TieredStore("cpu", disk_dir=tmp_path, device_budget=block(0).numel() * 4, host_budget=0)
    with caplog.at_level("WARNING", logger="pckernels.store.disk"), disk_full(how, monkeypatch):
        store.put(key(1), block(1))
    assert block_files(tmp_path) == []
    assert "File too large" in caplog.text and "disk tier off" in caplog.text
    stats = store.stats()["disk"]
    assert stats["enabled"] is False and "File too large" in stats["off_reason"]
    assert stats["writes"] == 0 and stats["entries"] == 0 and stats["bytes"] == 0
    assert torch.equal(store.get(key(1)), block(1))
    caplog.clear()
    with caplog.at_level("WARNING"):
        store.put(key(2), block(2))
    assert caplog.text == "" and block_files(tmp_path) == []
    assert store.get(key(1)) is None and key(1) not in store
    assert store.stats()["dropped"] == 1 and store.stats()["misses"] == 1
    assert torch.equal(store.get(key(2)), block(2))


def test_files_written_before_the_disk_filled_stay_whole(tmp_path, monkeypatch):
    store = TieredStore("cpu", disk_dir=tmp_path)
    store.put(key(1), block(1))
    with disk_full("patched", monkeypatch):
        store.put(key(2), block(2))
    assert [p.name for p in block_files(tmp_path)] == [store.disk.path(key(1).digest).name]
    assert torch.equal(read_block(store.disk.path(key(1).digest), key(1).digest), block(1))


def test_store_dir_that_is_a_file_turns_the_tier_off(tmp_path, caplog):
    path = tmp_path / "kv"
    path.write_text("not a directory")
    with caplog.at_level("WARNING", logger="pckernels.store.disk"):
        store = TieredStore("cpu", disk_dir=path)
    assert "disk tier off" in caplog.text and str(path) in caplog.text
    assert key(1) not in store
    store.put(key(1), block(1))
    assert torch.equal(store.get(key(1)), block(1))
    store.prefetch([key(1), key(2)])
    assert store.get(key(2)) is None
    stats = store.stats()["disk"]
    assert stats["enabled"] is False and "cannot use directory" in stats["off_reason"]
    assert path.read_text() == "not a directory"


def test_disk_budget_evicts_oldest_and_scan_restores_order(tmp_path):
    size = write_block(tmp_path / "probe.safetensors", key(0), block(0))
    disk = DiskTier(tmp_path / "d", budget=3 * size + 10, policy="lru")
    for i in range(5):
        assert disk.write(key(i), block(i))
        os.utime(disk.path(key(i).digest), (1000 + i, 1000 + i))
        assert disk.nbytes <= disk.budget
    assert [k for k in map(key, range(5)) if k in disk] == [key(2), key(3), key(4)]
    assert disk.stats.evictions == 2
    stale = disk.path(key(9).digest).with_name(TEMP_PREFIX + "x.safetensors")
    stale.write_bytes(b"partial")
    os.utime(stale, (0, 0))
    again = DiskTier(tmp_path / "d", budget=3 * size + 10, policy="lru")
    assert len(again) == 3 and not stale.exists()
    again.write(key(7), block(7))
    assert key(2) not in again and key(7) in again


def _writer(root: str, writer: int, rounds: int) -> None:
    disk = DiskTier(root, budget=1 << 30)
    for r in range(rounds):
        for i in range(6):
            disk.write(key(i), block(i) + writer * 0.5)


def test_concurrent_writers_never_expose_a_partial_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), w, 25)) for w in (1, 2)]
    for p in writers:
        p.start()
    reader = DiskTier(tmp_path, budget=1 << 30)
    reads = 0
    while any(p.is_alive() for p in writers):
        for i in range(6):
            outcome, _ = reader.read_raw(key(i), pin=False)
            if isinstance(outcome, FileNotFoundError):
                continue
            assert isinstance(outcome, torch.Tensor), outcome
            assert torch.equal(outcome, block(i) + 0.5) or torch.equal(outcome, block(i) + 1.0)
            reads += 1
    for p in writers:
        p.join()
        assert p.exitcode == 0
    assert reads > 0
    assert all(e["status"] == "ok" for e in list_blocks(tmp_path)) and len(list_blocks(tmp_path)) == 6
    assert not [p for p in tmp_path.rglob(TEMP_PREFIX + "*")]


def test_lru_policy_evicts_least_recent():
    lru = LRUPolicy()
    for k in "abc":
        lru.admit(k, 10)
    lru.touch("a")
    assert lru.victim() == "b"


def test_greedy_dual_size_keeps_small_hot_entries_over_a_large_cold_one():
    gds = GreedyDualSizePolicy(CostModel(1e-3, 1e9))
    gds.admit("big", 1_000_000)
    for k in ("s1", "s2"):
        gds.admit(k, 1_000)
        gds.touch(k)
    assert gds.victim() == "big"
    gds.remove("big")
    gds.admit("new", 1_000)
    assert gds.victim() == "new"


def test_greedy_dual_size_ages_entries():
    gds = GreedyDualSizePolicy(CostModel(1e-3, 1e9))
    gds.admit("old", 1_000)
    for _ in range(3):
        gds.touch("old")
    for i in range(10):
        gds.admit(i, 1_000)
        victim = gds.victim()
        gds.remove(victim)
    assert "old" not in gds._entries


def test_parse_size():
    assert parse_size("512MiB") == 512 << 20 and parse_size("2GB") == 2_000_000_000
    assert parse_size(123) == 123 and parse_size("1.5k") == 1536
    assert parse_size(" 2 GiB ") == 2 << 30 and parse_size("+1kb") == 1000 and parse_size(0) == 0
    with pytest.raises(ValueError, match="^size is not a size: 'lots'"):
        parse_size("lots")


@pytest.mark.parametrize("name", ["device_budget", "host_budget", "disk_budget"])
@pytest.mark.parametrize("value, message", [
    (-1, "must not be negative"),
    (-0.5, "must not be negative"),
    ("-1GiB", "must not be negative"),
    ("\u22121GiB", "must not be negative"),
    (" - 512MB", "must not be negative"),
    ("lots", "is not a size"),
    ("2 gigs", "is not a size"),
    ("1e9", "is not a size"),
    ("", "is not a size"),
    (float("nan"), "must be a finite number"),
    (float("inf"), "must be a finite number"),
    (True, "must be a number of bytes or a size string"),
    ([1024], "must be a number of bytes or a size string"),
])
def test_bad_budgets_are_refused_naming_the_argument(tmp_path, name, value, message):
    with pytest.raises(ValueError, match=f"^{name} {message}"):
        TieredStore("cpu", disk_dir=tmp_path / "kv", **{name: value})
    assert not (tmp_path / "kv").exists()


def test_disk_tier_refuses_a_negative_budget(tmp_path):
    with pytest.raises(ValueError, match="disk budget must not be negative"):
        DiskTier(tmp_path, budget=-1)


@pytest.mark.parametrize("policy, with_disk", [("gds", True), ("lru", True), ("gds", False)])
def test_budgets_hold_and_blocks_stay_correct_under_random_operations(tmp_path, policy, with_disk):
    rng = random.Random(0)
    sizes = {i: rng.choice([1, 2, 4, 16, 64]) for i in range(30)}
    unit = block(0, n=1).numel() * 4
    store = TieredStore("cpu", device_budget=40 * unit, host_budget=80 * unit, policy=policy,
                        disk_dir=tmp_path if with_disk else None, disk_budget=int(1.5 * sum(sizes.values()) * unit + 30e3))
    present: set[int] = set()
    for _ in range(400):
        i = rng.randrange(30)
        op = rng.random()
        if op < 0.3 or i not in present:
            store.put(key(i), block(i, n=sizes[i]))
            present.add(i)
        elif op < 0.9:
            got = store.get(key(i))
            if got is None:
                assert not with_disk
                present.discard(i)
            else:
                assert torch.equal(got, block(i, n=sizes[i]))
        else:
            store.prefetch([key(j) for j in rng.sample(sorted(present), min(3, len(present)))])
        assert store.device_tier.nbytes <= store.device_tier.budget
        assert store.host_tier.nbytes <= store.host_tier.budget
        if with_disk:
            assert store.disk.nbytes <= store.disk.budget
    stats = store.stats()
    assert stats["device"]["evictions"] > 0 and stats["host"]["evictions"] > 0
    store.close()
