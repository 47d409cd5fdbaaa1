"""Requests of a hybrid model decoding together: one transformers cache with a row per request.

A model with recurrent layers (Mamba, gated delta nets, short convolutions) cannot have its
requests packed into one sequence the way the arena runner packs attention: a recurrent layer
would carry state from one request into the next. They decode as a batch instead — what
``generate`` does with padding — in one ``DynamicCache`` whose rows are the requests:
attention layers hold every row's keys and values **left-padded** to a common length (row ``b``'s
``n`` tokens in the last ``n`` columns; a 2D mask marks the padding, so a padded key contributes
exactly nothing), recurrent layers hold each row's fixed-size states stacked. Every step appends
the same number of tokens to every row, at each row's own positions.

The batch is rebuilt when its rows change (a request joins after reading its prompt alone, or
leaves): each staying row's states are copied once into the new cache with the joining rows'.
Nothing here looks at a request; rows are (cache, row index, length) sources.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pckernels.prefix.states import HYBRID, KV, LINEAR, CacheStates, copy_states, layer_states, put_kv, put_states


@dataclass
class Source:
    """A row's states before a rebuild: row ``index`` of ``cache``, holding ``length`` tokens (the
    last ``length`` key/value columns)."""

    cache: object
    index: int
    length: int


class HybridBatch:
    """Rows decoding together (module docstring). ``states``: the model's cache handling (its
    layer ``kinds`` known); ``sources``: the rows, in order."""

    def __init__(self, states: CacheStates, sources: list[Source], device: torch.device) -> None:
        self.states = states
        self.lengths = [source.length for source in sources]
        total = max(self.lengths)
        self.cache = states.new_cache()
        self.mask = torch.zeros(len(sources), total, dtype=torch.long, device=device)
        for row, length in enumerate(self.lengths):
            self.mask[row, total - length:] = 1
        for index, kind in enumerate(states.kinds):
            if kind in (KV, HYBRID):
                self._stack_kv(index, sources, total)
            if kind in (LINEAR, HYBRID):
                self._stack_states(index, sources)

    def _stack_kv(self, index: int, sources: list[Source], total: int) -> None:
        """Layer ``index``'s keys and values ``[B, H, total, D]``, each row right-aligned (put as
        the prefix cache's restore puts them: :func:`~pckernels.prefix.states.put_kv`)."""
        first = sources[0].cache.layers[index].keys
        shape = (len(sources), first.shape[1], total, first.shape[3])
        keys = torch.zeros(shape, dtype=first.dtype, device=first.device)
        values = torch.zeros(shape, dtype=sources[0].cache.layers[index].values.dtype, device=first.device)
        for row, source in enumerate(sources):
            layer = source.cache.layers[index]
            end = layer.keys.shape[-2]
            keys[row, :, total - source.length:] = layer.keys[source.index, :, end - source.length:end]
            values[row, :, total - source.length:] = layer.values[source.index, :, end - source.length:end]
        put_kv(self.cache, index, keys, values)

    def _stack_states(self, index: int, sources: list[Source]) -> None:
        """Layer ``index``'s convolution and recurrent states ``[B, ...]``, one row per source (read
        and put as the prefix cache's snapshots and restores do: ``layer_states``, ``put_states``)."""
        rows = [layer_states(source.cache, index) for source in sources]
        pairs = []
        for state, first in enumerate(rows[0]):
            pairs.append(tuple(None if first[part] is None
                               else torch.cat([row[state][part][s.index:s.index + 1] for row, s in zip(rows, sources)])
                               for part in (0, 1)))
        put_states(self.cache, index, tuple(pairs))

    def __len__(self) -> int:
        return len(self.lengths)

    def source(self, row: int) -> Source:
        """Row ``row`` as a source for the next rebuild."""
        return Source(self.cache, row, self.lengths[row])

    def forward(self, model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Forward ``ids [B, q]`` at ``positions [B, q]`` (every row ``q`` tokens); logits ``[B, q, vocab]``."""
        q = ids.shape[1]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self), q)], dim=1)
        self.lengths = [length + q for length in self.lengths]
        out = model(input_ids=ids, position_ids=positions, attention_mask=self.mask, use_cache=True,
                    logits_to_keep=q, **{self.states.cache_argument: self.cache})
        return out.logits[:, -q:]

    def snapshot(self) -> tuple[int, list]:
        """What :meth:`rewind` goes back to: the key/value length and copies of the recurrent states."""
        return self.mask.shape[1], self.states.recurrent_snapshot(self.cache)

    def rewind(self, snapshot: tuple[int, list]) -> None:
        """Back to ``snapshot``: keys and values cut to its length, recurrent states copied back
        (every row: call it when every row is to go back)."""
        total, states = snapshot
        drop = self.mask.shape[1] - total
        self.mask = self.mask[:, :total]
        self.lengths = [length - drop for length in self.lengths]
        for index, kind in enumerate(self.states.kinds):
            layer = self.cache.layers[index]
            if kind in (KV, HYBRID):
                put_kv(self.cache, index, layer.keys[..., :total, :], layer.values[..., :total, :])
            if kind in (LINEAR, HYBRID):
                copy_states(self.cache, index, states[index])
