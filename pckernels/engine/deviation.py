"""Deviation scores for selective recompute (the ``deviation`` policy).

A cached token's states were computed within its module's scope; in a prompt they are read next
to other modules they never attended to. How much that matters differs per token: function
words barely change with context, tokens that refer back to earlier text change a lot. The
score measures it once per schema: the schema's modules are read in one forward in document
order, every token attending to every earlier token that can appear with it (union alternatives
hide each other), and each token's keys and values there are compared with its cached ones.
Score = mean over layers of ``(|K_ctx - K| / |K_ctx| + |V_ctx - V| / |V_ctx|) / 2``, norms over
heads and head dims. Layer 0 never deviates (its K/V depend on the token alone), tokens whose
scope holds everything before them score 0.

The schema order is the "typical context": for a prompt that imports modules in schema order
(documents in a library, say) the score ranks exactly the tokens that deviate in that prompt;
for other orders or subsets it is a proxy. Cost: one forward over the schema's tokens with an
``n x n`` mask, hence ``MAX_TOKENS``.
"""

from __future__ import annotations

import logging
import time

import torch

from pckernels.engine.buffer import AssemblyBuffer, BufferCache
from pckernels.engine.context import EngineContext
from pckernels.integration.attention import AttentionSpec
from pckernels.pml.model import Schema

log = logging.getLogger(__name__)

MAX_TOKENS = 8192
"""Largest schema (own tokens of all modules) scored; beyond it use the ``first`` policy."""


class DeviationScores:
    """Per schema (by digest), per module, a float32 ``[own tokens]`` tensor of scores; computed
    on first use and kept."""

    def __init__(self, ctx: EngineContext) -> None:
        self._ctx = ctx
        self._scores: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def for_schema(self, schema: Schema) -> dict[str, torch.Tensor]:
        version = (schema.salt, schema.digest)
        scores = self._scores.get(version)
        if scores is None:
            t0 = time.perf_counter()
            scores = self._scores[version] = _score(self._ctx, schema)
            log.info("deviation scores for schema %r in %.2f s", schema.name, time.perf_counter() - t0)
        return scores


def _union_choices(schema: Schema, module: str) -> dict[str, str]:
    """``union -> member`` for the unions ``module`` or one of its ancestors belongs to."""
    choices = {}
    for name in (module, *schema.modules[module].ancestors(schema.modules)):
        union = schema.modules[name].union
        if union is not None:
            choices[union] = name
    return choices


def _compatible(schema: Schema) -> torch.Tensor:
    """Boolean ``[modules, modules]``: both can be imported by one prompt."""
    names = list(schema.modules)
    choices = [_union_choices(schema, name) for name in names]
    out = torch.ones(len(names), len(names), dtype=torch.bool)
    for i, a in enumerate(choices):
        for j, b in enumerate(choices):
            out[i, j] = all(b.get(union, member) == member for union, member in a.items())
    return out


@torch.inference_mode()
def _score(ctx: EngineContext, schema: Schema) -> dict[str, torch.Tensor]:
    names = list(schema.modules)
    owner, tokens, positions = [], [], []
    for i, name in enumerate(names):
        module = schema.modules[name]
        owner.extend([i] * len(module.token_ids))
        tokens.extend(module.token_ids)
        positions.extend(module.position_ids)
    n = len(tokens)
    if n > MAX_TOKENS:
        raise ValueError(f"schema {schema.name!r} has {n} module tokens; deviation scores are computed for at "
                         f"most {MAX_TOKENS}; use recompute_policy='first'")
    order = sorted(range(n), key=lambda k: (positions[k], owner[k]))
    device = ctx.device
    own = torch.tensor([owner[k] for k in order], dtype=torch.long)
    pos = torch.tensor([positions[k] for k in order], dtype=torch.long)
    visible = (pos[None, :] <= pos[:, None]) & _compatible(schema)[own[:, None], own[None, :]]
    bias = torch.zeros(n, n, dtype=ctx.dtype).masked_fill_(~visible, float("-inf")).to(device)
    pos = pos.to(device)
    buf = AssemblyBuffer(ctx.layout, dtype=ctx.dtype, device=device, capacity=n)
    cache = BufferCache(buf)
    cache.prepare(rows=None, start=0, extent=n)
    ids = torch.tensor([[tokens[k] for k in order]], dtype=torch.long, device=device)
    ctx.adapter.forward(ids, pos[None], AttentionSpec(bias, pos, pos), cache)
    row_of = {k: row for row, k in enumerate(order)}
    scores: dict[str, torch.Tensor] = {}
    start = 0
    for name in names:
        count = len(schema.modules[name].token_ids)
        rows = torch.tensor([row_of[k] for k in range(start, start + count)], dtype=torch.long, device=device)
        start += count
        if not schema.modules[name].cached:
            continue
        in_context = buf.data.index_select(3, rows).float()
        isolated = ctx.blocks.fetch_block(schema, name).float()
        diff = (in_context - isolated).norm(dim=(2, 4)) / in_context.norm(dim=(2, 4)).clamp_min(1e-6)
        scores[name] = diff.mean(dim=(0, 1)).cpu()
    return scores
