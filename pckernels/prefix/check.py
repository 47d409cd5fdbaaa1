"""The prefix cache's self-check: does this model continue a prefill exactly from restored states?

Exact reuse rests on two facts the check verifies on random tokens before a model is trusted: a
prefill read in chunks continues from its cache (it agrees with a one-pass prefill far more
closely than one that ignores the earlier tokens), and a prefill resumed from restored states —
keys and values, recurrent snapshots — is bitwise equal to the uninterrupted one, for the last
logits and a decode step after them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pckernels.prefix.states import UnsupportedCacheError

PROBE_CHUNK = 8
"""Tokens per chunk of the check's prefills."""


class Checked(Protocol):
    """What the check uses of a :class:`~pckernels.prefix.PrefixCache`."""

    model: torch.nn.Module
    device: torch.device
    states: object
    """Makes working caches and copies states out and in (``CacheStates`` or a subclass's)."""

    def run_chunks(self, ids: torch.Tensor, cache, start: int, chunk: int, on_chunk=None) -> torch.Tensor: ...

    def forward_chunk(self, cache, input_ids: torch.Tensor, first_position: int) -> torch.Tensor: ...


def self_check(cache: Checked) -> str | None:
    """``None`` when exact reuse works for ``cache``'s model, else the reason it is refused.

    Uses :data:`PROBE_CHUNK`-token chunks on ``3 * chunk + 3`` random tokens: a chunked prefill
    must match a one-pass prefill far more closely than a prefill that ignores the earlier
    tokens does; resuming at a chunk boundary and restoring the prompt end must then both be
    bitwise equal to the uninterrupted prefill, for the last logits and a decode step.
    """
    chunk = PROBE_CHUNK
    states = cache.states
    vocab = cache.model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, 3 * chunk + 3), generator=torch.Generator().manual_seed(0))
    ids = ids.to(cache.device)
    n = ids.shape[1]
    pieces: list[list] = []
    states_at: dict[int, list] = {}
    with torch.no_grad():
        reference = states.new_cache()

        def record(chunk_start: int, chunk_end: int) -> None:
            if states.kinds is None:
                states.inspect(reference)
            pieces.append(states.kv_slice(reference, chunk_start, chunk_end))
            states_at[chunk_end] = states.recurrent_snapshot(reference)

        try:
            chunked = cache.run_chunks(ids, reference, 0, chunk, on_chunk=record)
        except UnsupportedCacheError as exc:
            return str(exc)
        one_pass = cache.forward_chunk(states.new_cache(), ids, 0)
        without_context = cache.forward_chunk(states.new_cache(), ids[:, n - 3:], n - 3)
        error = (chunked - one_pass).abs().max().item()
        if not error <= 0.01 * (without_context - one_pass).abs().max().item():
            return (f"a chunked prefill differs from a one-pass prefill (max |diff| {error:.3g}); the model "
                    "does not continue a multi-token forward from its cached state")
        resumed = states.new_cache()
        states.restore(resumed, pieces[:2], states_at[2 * chunk])
        resumed_logits = cache.run_chunks(ids, resumed, 2 * chunk, chunk)
        repeated = states.new_cache()
        states.restore(repeated, pieces, states_at[n])
        step = torch.tensor([[int(chunked.argmax())]], device=cache.device)
        expected = cache.forward_chunk(reference, step, n)
        if not (torch.equal(resumed_logits, chunked) and torch.equal(cache.forward_chunk(resumed, step, n), expected)
                and torch.equal(cache.forward_chunk(repeated, step, n), expected)):
            return "a prefill resumed from restored states is not bitwise equal to an uninterrupted one"
    return None
