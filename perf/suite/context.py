"""What every experiment works with: the engine, an exact prefix cache on the same model, the
settings and a progress ticker."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from pckernels.engine import PromptCache
from pckernels.pml.model import ROOT, ResolvedPrompt, Schema

from perf.suite.config import SuiteConfig

log = logging.getLogger(__name__)


class Ticker:
    """Advances one task of a ``rich.progress.Progress`` (or does nothing without one)."""

    def __init__(self, progress=None) -> None:
        self.progress = progress
        self._task = None

    def start(self, description: str, total: int) -> None:
        if self.progress is not None:
            self._task = self.progress.add_task(description, total=max(total, 1))

    def advance(self, steps: int = 1) -> None:
        if self.progress is not None and self._task is not None:
            self.progress.advance(self._task, steps)

    def finish(self) -> None:
        if self.progress is not None and self._task is not None:
            task = self.progress.tasks[self._task]
            self.progress.update(self._task, completed=task.total)


class EnginePrefix:
    """Exact prefix reuse as a user of the engine gets it: ``engine.complete`` (plain prompts read
    into the arena by the engine's prefix cache, decoding in the engine's batch)."""

    def __init__(self, engine: PromptCache) -> None:
        self.engine = engine

    def complete(self, prompt, *, max_new_tokens: int = 64, reuse: bool = True):
        return self.engine.complete(prompt, max_new_tokens=max_new_tokens, reuse=reuse)

    def clear(self) -> None:
        self.engine.prefix.clear()

    def stats(self) -> dict:
        return self.engine.prefix.stats()


@dataclass
class Bench:
    """``engine``: Prompt Cache; ``prefix``: exact prefix reuse through the same engine
    (``engine.complete``), its block size the config's ``prefix_block_size``."""

    engine: PromptCache
    config: SuiteConfig
    ticker: Ticker = field(default_factory=Ticker)
    _prefix: EnginePrefix | None = None

    @property
    def prefix(self) -> EnginePrefix:
        if self._prefix is None:
            if self.engine.prefix_block_size != self.config.prefix_block_size:
                raise ValueError(f"the engine reads plain prompts in blocks of {self.engine.prefix_block_size} "
                                 f"tokens, the config asks for {self.config.prefix_block_size}: build it with "
                                 "PromptCache(..., prefix_block_size=config.prefix_block_size)")
            self._prefix = EnginePrefix(self.engine)
        return self._prefix

    def clear_caches(self) -> None:
        """Empty the engine's store, the blocks resident in its arena, and the prefix cache."""
        self.engine.store.clear()
        self.engine.evict_resident()
        if self._prefix is not None:
            self._prefix.clear()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def add_schema(self, text: str) -> Schema:
        schema = self.engine.add_schema(text)
        log.debug("schema %s: %d positions", schema.name, schema.length)
        return schema

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def natural_order_ids(resolved: ResolvedPrompt, order: Sequence[str]) -> list[int]:
    """The prompt's token ids with the imported modules ``order`` laid out in that order.

    Prompt Cache places modules at their schema positions, whatever order they are listed in; a prompt built
    without it (no reuse, prefix reuse) concatenates them as the application retrieved them.
    The text before the first and after the last of these modules stays where it is."""
    live = resolved.live_segments()
    moved = [i for i, s in enumerate(live) if s.kind == "cached" and s.module in order and s.module != ROOT]
    if sorted({live[i].module for i in moved}) != sorted(order):
        raise ValueError(f"the prompt does not import exactly {sorted(order)}")
    first, last = moved[0], moved[-1]
    if any(live[i].module not in order for i in range(first, last + 1)):
        raise ValueError("the reordered modules must be adjacent in the prompt")
    by_module: dict[str, list[int]] = {}
    for i in moved:
        by_module.setdefault(live[i].module, []).extend(live[i].token_ids)
    ids = [t for s in live[:first] for t in s.token_ids]
    for module in order:
        ids.extend(by_module[module])
    ids.extend(t for s in live[last + 1:] for t in s.token_ids)
    return ids
