"""The memory tiers: device and (pinned) host memory, each within a budget, a block in at most one.

When the device tier is over budget its victim moves to the host tier; when the host tier is over
budget its victim leaves memory through ``spill`` (the store keeps it on disk). On CUDA, host
memory is pinned and host-to-device copies run on a side stream with ``non_blocking=True``; the
consuming stream waits on the copy's event (no host sync). On CPU the "device" is host memory too:
moving between the two tiers moves a reference, no copy.
"""

from __future__ import annotations

from typing import Callable

import torch

from pckernels.store.events.ledger import NO_PLACE
from pckernels.store.keys import BlockKey
from pckernels.store.policy import EvictionPolicy


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class MemoryTier:
    """Blocks held in memory within ``budget`` bytes, ordered for eviction by ``policy``; what it
    gains and loses is told to ``events`` (a KV-event :class:`~pckernels.store.events.Place`)."""

    def __init__(self, name: str, budget: int, policy: EvictionPolicy) -> None:
        self.name = name
        self.events = NO_PLACE
        self.budget = int(budget)
        self.policy = policy
        self.blocks: dict[BlockKey, torch.Tensor] = {}
        self.nbytes = 0
        self.hits = 0
        self.evictions = 0

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.blocks

    def free(self) -> int:
        return self.budget - self.nbytes

    def add(self, key: BlockKey, block: torch.Tensor, hits: int = 1) -> None:
        self.blocks[key] = block
        self.nbytes += nbytes_of(block)
        self.policy.admit(key, nbytes_of(block), hits)
        self.events.hold(key.digest, key.info)

    def pop(self, key: BlockKey) -> torch.Tensor:
        block = self.blocks.pop(key)
        self.nbytes -= nbytes_of(block)
        self.policy.remove(key)
        self.events.drop(key.digest)
        return block

    def clear(self) -> None:
        for key in list(self.blocks):
            self.pop(key)


class MemoryTiers:
    """``device_tier`` over ``host_tier`` on ``device`` (see the module docstring); a block evicted
    from host memory goes to ``spill(key, block)``. Not thread-safe: the store's lock guards it."""

    def __init__(self, device: torch.device, device_tier: MemoryTier, host_tier: MemoryTier,
                 spill: Callable[[BlockKey, torch.Tensor], None]) -> None:
        self.device = device
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.spill = spill
        self.pin = device.type == "cuda"
        self.uses: dict[BlockKey, int] = {}
        """``get`` calls per key, carried across tiers so a block keeps its frequency when it moves."""
        self._copy_stream = torch.cuda.Stream(device) if self.pin else None
        self._copy_done: dict[BlockKey, torch.cuda.Event] = {}

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.device_tier or key in self.host_tier

    def add_device(self, key: BlockKey, block: torch.Tensor) -> None:
        """Put ``block`` (on the device) in the device tier, moving its victims to the host tier."""
        size = nbytes_of(block)
        tier = self.device_tier
        while tier.nbytes + size > tier.budget:
            victim = tier.policy.victim()
            tier.evictions += 1
            self.add_host(victim, self.to_host(self.usable(victim, tier.pop(victim))))
        tier.add(key, block, self.uses.get(key, 1))

    def add_host(self, key: BlockKey, block: torch.Tensor) -> None:
        """Put ``block`` (in host memory) in the host tier, spilling its victims (or itself, when
        larger than the whole tier)."""
        size = nbytes_of(block)
        tier = self.host_tier
        if size > tier.budget:
            self._leave(key, block)
            return
        while tier.nbytes + size > tier.budget:
            victim = tier.policy.victim()
            tier.evictions += 1
            self._leave(victim, tier.pop(victim))
        tier.add(key, block, self.uses.get(key, 1))

    def _leave(self, key: BlockKey, block: torch.Tensor) -> None:
        self._copy_done.pop(key, None)
        self.spill(key, block)

    def remove(self, key: BlockKey) -> None:
        """Forget ``key``'s block in either tier (no spill)."""
        for tier in (self.device_tier, self.host_tier):
            if key in tier:
                tier.pop(key)
        self._copy_done.pop(key, None)

    def promote(self, key: BlockKey, host_block: torch.Tensor) -> torch.Tensor:
        """Move a host-memory block up: to the device tier when it fits the budget, else back to
        the host tier (the caller still gets a device copy)."""
        block = self.to_device(key, host_block, wait=True)
        if nbytes_of(block) <= self.device_tier.budget:
            self.add_device(key, block)
        else:
            self.add_host(key, host_block)
        return block

    def to_device(self, key: BlockKey, host_block: torch.Tensor, *, wait: bool) -> torch.Tensor:
        """Copy to the device: on CUDA asynchronously on the side stream. ``wait``: the current
        stream waits for the copy now; otherwise the wait happens when the block is used."""
        if self._copy_stream is None:
            return host_block.to(self.device)
        with torch.cuda.stream(self._copy_stream):
            block = host_block.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._copy_done[key] = done
        return self.usable(key, block) if wait else block

    def usable(self, key: BlockKey, block: torch.Tensor) -> torch.Tensor:
        """``block`` made safe to use on the current stream (waits for a pending copy on the GPU)."""
        done = self._copy_done.pop(key, None)
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            block.record_stream(stream)
        return block

    def to_host(self, block: torch.Tensor) -> torch.Tensor:
        if block.device.type == "cpu":
            return block
        host = torch.empty(block.shape, dtype=block.dtype, pin_memory=self.pin)
        host.copy_(block)
        return host

    def clear(self) -> None:
        """Forget every block of both tiers (no spill)."""
        self.device_tier.clear()
        self.host_tier.clear()
        self._copy_done.clear()
