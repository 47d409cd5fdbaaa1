"""The tiered block store: device memory, (pinned) host memory and disk, each within a budget.

Blocks are ``[L, 2, H, n, D]`` tensors keyed by ``BlockKey``. Placement rules:

* ``put`` writes the block through to disk (when there is a disk tier: this is what survives a
  restart) and keeps it on the device.
* The device and host tiers are exclusive (``memory.py``): a block lives in at most one of them.
  When the device tier is over budget its victim moves to the host tier; when the host tier is
  over budget its victim is dropped from memory (written to disk first if the file is missing).
  When the disk tier is over budget its victim's file is deleted (re-encoded on next use). A disk
  tier that cannot write (disk full, a file where its directory should be) turns itself off.
* With a remote tier (Redis/Valkey, ``remote/``) below disk, ``put`` also queues the block for
  a background upload, a local miss reads through to the server (the block is then written to
  disk and promoted like any other), and ``publish`` uploads blocks that stay out of the local
  tiers (prefix-cache blocks). Remote faults only ever cost a miss.
* ``get`` moves a block up to the device tier (returns it on the engine's device) or returns
  ``None`` when no tier holds it (the caller re-encodes and ``put``\\ s it).
* ``prefetch`` stages blocks without evicting anything: host blocks are copied to the device
  if it has room, disk blocks are read by a background thread into the host tier if it has room.

On CUDA, host memory is pinned and host-to-device copies run on a side stream (``memory.py``).
Budgets hold after every public call returns. Thread-safe: public methods take the store's lock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

import torch

from pckernels.store.disk import DiskTier
from pckernels.store.events.ledger import MEDIUMS, NO_PLACE, BlockLedger
from pckernels.store.keys import BlockKey
from pckernels.store.memory import MemoryTier, MemoryTiers, nbytes_of
from pckernels.store.policy import CostModel, make_policy
from pckernels.store.remote import DEFAULT_NAMESPACE, RemoteTier

log = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_CPU_DEVICE_BUDGET = 1 * GiB
DEFAULT_CUDA_DEVICE_FRACTION = 0.25
DEFAULT_HOST_BUDGET = 4 * GiB
DEFAULT_DISK_BUDGET = 20 * GiB

REFILL_COST = {
    "device-cuda": CostModel(20e-6, 12e9),
    "device-cpu": CostModel(1e-6, 20e9),
    "host": CostModel(50e-6, 400e6),
    "disk": CostModel(20e-3, 50e6),
}
"""Rough seconds to bring a block back into each tier from the one below (host <- disk is a
read plus sha256; disk <- re-encode). Only the ratios matter to GreedyDual-Size."""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
          "mib": 1 << 20, "g": GiB, "gb": 1000 ** 3, "gib": GiB, "t": 1 << 40, "tb": 1000 ** 4, "tib": 1 << 40}


def parse_size(value: int | float | str, name: str = "size") -> int:
    """Bytes from ``1048576``, ``"512MiB"``, ``"2GB"``, ``"1.5g"``. Anything else — negative,
    not finite, not a number or size string — is a ``ValueError`` naming ``name``."""
    examples = "examples: 1048576, 512MiB, 2GB"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
        number, unit = value, ""
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([-+\u2212]?)\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(3).lower() not in _UNITS:
            raise ValueError(f"{name} is not a size: {value!r} ({examples})")
        number = -float(match.group(2)) if match.group(1) in ("-", "\u2212") else float(match.group(2))
        unit = match.group(3).lower()
    else:
        raise ValueError(f"{name} must be a number of bytes or a size string ({examples}), got {value!r}")
    if number < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return int(number * _UNITS[unit])


def parse_budgets(**budgets: int | float | str | None) -> dict[str, int | None]:
    """``parse_size`` of each budget given by name; ``None`` (the default) passes through."""
    return {name: None if value is None else parse_size(value, name) for name, value in budgets.items()}


def default_device_budget(device: torch.device) -> int:
    """A quarter of the GPU's memory on CUDA; 1 GiB on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * DEFAULT_CUDA_DEVICE_FRACTION)
    return DEFAULT_CPU_DEVICE_BUDGET


def _locked(method):
    """Run ``method`` holding the store's lock (one caller at a time; re-entrant)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class TieredStore:
    """Device / host / disk block store (see the module docstring). Safe to share between
    threads: every public method holds the store's lock.

    ``device_budget``, ``host_budget``, ``disk_budget``: bytes or strings like ``"2GiB"``; ``None``
    takes the default (device: a quarter of the GPU, 1 GiB on CPU; host 4 GiB; disk 20 GiB); a
    negative or unreadable budget is a ``ValueError`` naming it, raised before anything is set up.
    ``disk_dir=None`` means no disk tier. ``policy``: ``"gds"`` (GreedyDual-Size-Frequency,
    default) or ``"lru"``. ``remote``: a :class:`RemoteTier` or its URL (``redis://host:port/db``),
    shared with other processes under ``remote_namespace``; ``None``: no remote tier.
    """

    def __init__(self, device: torch.device | str = "cpu", *, device_budget: int | str | None = None,
                 host_budget: int | str | None = None, disk_dir: str | os.PathLike | None = None,
                 disk_budget: int | str | None = None, policy: str = "gds",
                 remote: RemoteTier | str | None = None, remote_namespace: str = DEFAULT_NAMESPACE) -> None:
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.pin = on_cuda
        budgets = parse_budgets(device_budget=device_budget, host_budget=host_budget, disk_budget=disk_budget)
        dev_budget = budgets["device_budget"]
        if dev_budget is None:
            dev_budget = default_device_budget(self.device)
        host = budgets["host_budget"]
        disk = budgets["disk_budget"]
        self.device_tier = MemoryTier("device", dev_budget,
                                      make_policy(policy, REFILL_COST["device-cuda" if on_cuda else "device-cpu"]))
        self.host_tier = MemoryTier("host", DEFAULT_HOST_BUDGET if host is None else host,
                                    make_policy(policy, REFILL_COST["host"]))
        self.memory = MemoryTiers(self.device, self.device_tier, self.host_tier, self._drop)
        self.disk: DiskTier | None = None
        if disk_dir is not None:
            self.disk = DiskTier(disk_dir, DEFAULT_DISK_BUDGET if disk is None else disk,
                                 policy=policy, cost=REFILL_COST["disk"])
        if isinstance(remote, str):
            remote = RemoteTier(remote, namespace=remote_namespace)
        self.remote: RemoteTier | None = remote
        self.policy = policy
        self.misses = 0
        self.dropped = 0
        self.prefetched = 0
        self.encodes = 0
        self.encode_s = 0.0
        self._loader: ThreadPoolExecutor | None = None
        self._loading: dict[BlockKey, Future] = {}
        self._lock = threading.RLock()
        self.events: BlockLedger | None = None
        """Where KV events of its tiers go (:meth:`attach_events`); ``None``: off."""

    # -- the engine's interface -------------------------------------------------------------

    @_locked
    def __contains__(self, key: BlockKey) -> bool:
        self._collect_loads()
        return (key in self.memory or key in self._loading
                or (self.disk is not None and key in self.disk)
                or (self.remote is not None and self.remote.contains(key)))

    @_locked
    def get(self, key: BlockKey) -> torch.Tensor | None:
        """The block ``[L, 2, H, n, D]`` on the store's device, moved up to the device tier; ``None``
        if no tier holds a usable copy."""
        self._collect_loads()
        self.memory.uses[key] = self.memory.uses.get(key, 0) + 1
        if key in self.device_tier:
            self.device_tier.hits += 1
            self.device_tier.policy.touch(key)
            return self.memory.usable(key, self.device_tier.blocks[key])
        if key in self.host_tier:
            self.host_tier.hits += 1
            return self.memory.promote(key, self.host_tier.pop(key))
        block, source = None, None
        if key in self._loading and self._loading[key].cancel():
            del self._loading[key]
        if key in self._loading:
            block, source = self._accept_load(key, self._loading.pop(key).result())
        elif self.disk is not None:
            block, source = self.disk.read(key, pin=self.pin), "disk"
        if block is None and self.remote is not None and source != "remote":
            block, source = self.remote.read(key, pin=self.pin), "remote"
            if block is not None and self.disk is not None:
                self.disk.write(key, block)
        if block is None:
            self.misses += 1
            return None
        if source == "disk":
            self.disk.stats.hits += 1
            if self.remote is not None:
                self.remote.write_behind(key, block, nbytes_of(block))
        return self.memory.promote(key, block)

    @_locked
    def put(self, key: BlockKey, block: torch.Tensor) -> None:
        """Store a freshly encoded block (on the store's device): written through to disk, kept
        on the device tier (or the host tier when it exceeds the device budget)."""
        self._collect_loads()
        self.memory.remove(key)
        if self.disk is not None:
            self.disk.write(key, block)
        if self.remote is not None:
            self.remote.write_behind(key, block, nbytes_of(block))
        if nbytes_of(block) <= self.device_tier.budget:
            self.memory.add_device(key, block)
        else:
            self.memory.add_host(key, self.memory.to_host(block))

    def publish(self, key: BlockKey, make_block, nbytes: int) -> bool:
        """Queue a block for the remote tier only (not kept locally): ``make_block()`` returns it
        ``[L, 2, H, n, D]``, called in the writer thread if the server lacks it. Returns whether
        queued (``False`` without a remote tier or while it is unreachable or its queue is full)."""
        if self.remote is None:
            return False
        return self.remote.write_behind(key, make_block, nbytes)

    @_locked
    def share(self, keys: Iterable[BlockKey]) -> int:
        """Queue the locally held blocks of ``keys`` for the remote tier (those the server already
        has are skipped by the writer); returns how many were queued."""
        if self.remote is None:
            return 0
        queued = 0
        for key in keys:
            for tier in (self.device_tier, self.host_tier):
                if key in tier:
                    queued += self.remote.write_behind(key, tier.blocks[key], nbytes_of(tier.blocks[key]))
                    break
            else:
                if self.disk is not None and key in self.disk:
                    queued += self.remote.write_behind(key, functools.partial(self._read_for_upload, key),
                                                       self.disk.size_of(key))
        return queued

    def _read_for_upload(self, key: BlockKey) -> torch.Tensor:
        outcome, _ = self.disk.read_raw(key, False)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def claim(self, key: BlockKey) -> bool:
        """Whether to encode ``key`` here: ``False`` only while another process of the fleet holds its
        encoding lease (then :meth:`wait_for` its upload). Always ``True`` without a remote tier."""
        return True if self.remote is None else self.remote.claim(key)

    def wait_for(self, key: BlockKey) -> bool:
        """Wait for another process's upload of ``key``; whether the remote tier now holds it."""
        return False if self.remote is None else self.remote.wait_for(key)

    def release(self, key: BlockKey) -> None:
        """Give up the encoding lease of ``key`` early (no-op when not held; the upload releases it too)."""
        if self.remote is not None:
            self.remote.release(key)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the remote tier's queued writes (``True`` at once without one)."""
        return True if self.remote is None else self.remote.flush(timeout_s)

    @_locked
    def prefetch(self, keys: Iterable[BlockKey]) -> None:
        """Stage ``keys`` closer to the device without evicting anything (asynchronous)."""
        self._collect_loads()
        for key in keys:
            if key in self.device_tier or key in self._loading:
                continue
            if key in self.host_tier:
                if nbytes_of(self.host_tier.blocks[key]) <= self.device_tier.free():
                    self.memory.add_device(key, self.memory.to_device(key, self.host_tier.pop(key), wait=False))
                    self.prefetched += 1
            elif self.disk is not None and key in self.disk:
                if self.disk.size_of(key) <= self.host_tier.free():
                    self._loading[key] = self._submit(self._load_disk, key)
            elif self.remote is not None and self.remote.available and self.host_tier.free() > 0:
                self._loading[key] = self._submit(self._load_remote, key)

    @_locked
    def warm(self, keys: Iterable[BlockKey]) -> int:
        """Start background reads, into the host tier while it has room, of the ``keys`` only the
        remote tier holds (a schema another process encoded); returns how many were started."""
        if self.remote is None:
            return 0
        self._collect_loads()
        started = 0
        for key in keys:
            if key in self.memory or key in self._loading or (self.disk is not None and key in self.disk):
                continue
            if not self.remote.available or self.host_tier.free() <= 0:
                break
            self._loading[key] = self._submit(self._load_remote, key)
            started += 1
        return started

    def _submit(self, fn, key: BlockKey) -> Future:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-prefetch")
        return self._loader.submit(fn, key)

    def _load_disk(self, key: BlockKey) -> tuple[str, object]:
        return "disk", self.disk.read_raw(key, self.pin)

    def _load_remote(self, key: BlockKey) -> tuple[str, object]:
        return "remote", self.remote.read(key, pin=self.pin)

    def _accept_load(self, key: BlockKey, loaded: tuple[str, object]) -> tuple[torch.Tensor | None, str]:
        """A background read's block (``None``: absent or unusable) and where it came from."""
        source, result = loaded
        if source == "disk":
            return self.disk.accept(key, result), source
        if result is not None and self.disk is not None:
            self.disk.write(key, result)
        return result, source

    @_locked
    def record_encode(self, blocks: int, seconds: float) -> None:
        """Account ``blocks`` encoded by the engine in ``seconds`` (for ``stats``)."""
        self.encodes += blocks
        self.encode_s += seconds

    # -- inspection ---------------------------------------------------------------------------

    @_locked
    def __len__(self) -> int:
        """Blocks held in memory (device and host tiers)."""
        return len(self.device_tier.blocks) + len(self.host_tier.blocks)

    @_locked
    def keys(self) -> list[BlockKey]:
        """Keys held in memory, device tier first."""
        return list(self.device_tier.blocks) + list(self.host_tier.blocks)

    @_locked
    def nbytes(self) -> int:
        """Bytes held in memory (device and host tiers)."""
        return self.device_tier.nbytes + self.host_tier.nbytes

    @_locked
    def stats(self) -> dict:
        """Hits, bytes, budgets and evictions per tier; misses, loads, writes, encodes."""
        self._collect_loads()
        out: dict = {"policy": self.policy}
        for tier in (self.device_tier, self.host_tier):
            out[tier.name] = {"hits": tier.hits, "entries": len(tier.blocks), "bytes": tier.nbytes,
                              "budget": tier.budget, "evictions": tier.evictions}
        if self.disk is not None:
            out["disk"] = self.disk.describe()
        if self.remote is not None:
            out["remote"] = self.remote.describe()
        out.update(misses=self.misses, dropped=self.dropped, prefetched=self.prefetched,
                   encodes=self.encodes, encode_s=self.encode_s)
        return out

    @_locked
    def clear(self, *, disk: bool = False) -> None:
        """Forget every block held in memory (and delete the disk tier's files when ``disk``)."""
        self._collect_loads(wait=True)
        with self._clearing():
            self.memory.clear()
            if disk and self.disk is not None:
                self.disk.clear()

    def _clearing(self):
        return contextlib.nullcontext() if self.events is None else self.events.clearing()

    @_locked
    def attach_events(self, ledger: BlockLedger | None) -> None:
        """Tell ``ledger`` (a KV-event :class:`~pckernels.store.events.BlockLedger`) what each tier
        holds now and gains or loses from now on, as medium ``GPU`` (device), ``CPU`` (host) and
        ``DISK``; ``None`` stops. The remote tier is the fleet's, not this process's: it publishes
        nothing."""
        tiers = [(self.device_tier, "device"), (self.host_tier, "host")]
        for tier, name in tiers:
            tier.events.drop_all()
            tier.events = NO_PLACE if ledger is None else ledger.place(name, MEDIUMS[name])
            for key in tier.blocks:
                tier.events.hold(key.digest, key.info)
        self.events = ledger
        if self.disk is not None:
            self.disk.events.drop_all()
            self.disk.events = NO_PLACE if ledger is None else ledger.place("disk", MEDIUMS["disk"])
            for digest in list(self.disk._sizes):
                self.disk.events.hold(digest, None)

    @_locked
    def close(self) -> None:
        """Finish background reads, stop the loader thread, send queued remote writes (bounded)."""
        self._collect_loads(wait=True)
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self.remote is not None:
            self.remote.close()

    def _drop(self, key: BlockKey, block: torch.Tensor) -> None:
        """``key`` leaves memory: make sure the disk tier has it, else it is lost."""
        if self.disk is not None and (key in self.disk or self.disk.write(key, block)):
            return
        self.dropped += 1
        log.debug("block %s dropped from memory with no copy on disk", key.label)

    def _collect_loads(self, wait: bool = False) -> None:
        """Move finished background disk reads into the host tier while it has room."""
        for key in [k for k, f in self._loading.items() if wait or f.done()]:
            block, _ = self._accept_load(key, self._loading.pop(key).result())
            if block is None or key in self.memory:
                continue
            if nbytes_of(block) <= self.host_tier.free():
                self.host_tier.add(key, block, self.memory.uses.get(key, 1))
                self.prefetched += 1
