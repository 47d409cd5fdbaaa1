"""From a resolved prompt to what the forward needs: which cached blocks go to which rows,
which rows are computed fresh, which are dead; and the module-scoped mask of the oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pckernels.pml.model import ROOT, ResolvedPrompt, Schema


def scaffold_variants(prompt: ResolvedPrompt) -> dict[str, str]:
    """``module -> scaffold`` whose joint states apply to it (first applicable scaffold wins)."""
    variants: dict[str, str] = {}
    for name in prompt.scaffolds:
        for member in prompt.schema.scaffolds[name].members:
            variants.setdefault(member, name)
    return variants


def module_scope(schema: Schema, module: str, scaffold: str = "") -> frozenset[str]:
    """Modules whose own tokens ``module``'s tokens attend to: itself, its ancestors (the root
    included) and, when encoded within ``scaffold``, the scaffold's other members."""
    mod = schema.modules[module]
    scope = {module, *mod.ancestors(schema.modules)}
    if scaffold:
        scope.update(schema.scaffolds[scaffold].members)
    return frozenset(scope)


@dataclass(frozen=True)
class BlockUse:
    """One imported module's block placed at ``dst_row``; ``dead_rows`` are buffer rows of its
    parameter slots that no argument token fills."""

    module: str
    scaffold: str
    dst_row: int
    n_rows: int


@dataclass
class CachedPlan:
    """Everything the cached forward needs (plain Python data; tensors are made by the engine).

    ``blocks``: imported modules in document order with their buffer rows.
    ``new_tokens/new_positions/new_rows``: uncached tokens (arguments and text) in position order.
    ``dead_rows``: unused parameter-slot rows. ``rows``: rows in use after the prompt.
    """

    blocks: list[BlockUse]
    new_tokens: list[int]
    new_positions: list[int]
    new_rows: list[int]
    dead_rows: list[int]
    rows: int
    cached_tokens: int

    @property
    def new_rows_contiguous(self) -> bool:
        rows = self.new_rows
        return not rows or rows == list(range(rows[0], rows[0] + len(rows)))


def plan_cached(prompt: ResolvedPrompt) -> CachedPlan:
    """Lay the prompt's imported blocks out contiguously in document order, arguments at
    their slots' rows, uncached text after the blocks."""
    schema = prompt.schema
    variants = scaffold_variants(prompt)
    blocks: list[BlockUse] = []
    block_row: dict[str, int] = {}
    row = 0
    for name in prompt.modules:
        n = len(schema.modules[name].token_ids)
        blocks.append(BlockUse(name, variants.get(name, ""), row, n))
        block_row[name] = row
        row += n
    new_tokens: list[int] = []
    new_positions: list[int] = []
    new_rows: list[int] = []
    dead_rows: list[int] = []
    cached_tokens = row
    for module_name, param_name in prompt.arguments:
        param = _param(schema, module_name, param_name)
        arg = prompt.arguments[(module_name, param_name)]
        slot_row = block_row[module_name] + param.offset
        dead_rows.extend(range(slot_row + len(arg), slot_row + param.length))
        cached_tokens -= param.length
    text_row = row
    for seg in prompt.segments:
        if seg.kind == "argument":
            param = _param(schema, seg.module, seg.param)
            slot_row = block_row[seg.module] + param.offset
            rows = [slot_row + (p - param.start) for p in seg.position_ids]
        elif seg.kind == "text":
            rows = list(range(text_row, text_row + len(seg.token_ids)))
            text_row += len(seg.token_ids)
        else:
            continue
        new_tokens.extend(seg.token_ids)
        new_positions.extend(seg.position_ids)
        new_rows.extend(rows)
    return CachedPlan(blocks, new_tokens, new_positions, new_rows, sorted(dead_rows), text_row, cached_tokens)


def _param(schema: Schema, module: str, name: str):
    for param in schema.modules[module].params:
        if param.name == name:
            return param
    raise KeyError(f"{module}/{name}")


@dataclass
class ReferencePlan:
    """The oracle's single forward: every prompt token (slots included) in position order."""

    tokens: list[int]
    positions: list[int]
    live: list[bool]
    mask: torch.Tensor
    """Boolean ``[n, n]``: query i may attend to key j."""


def plan_reference(prompt: ResolvedPrompt) -> ReferencePlan:
    """Module tokens see the own tokens of their scope at earlier-or-equal positions;
    uncached tokens see every live token at an earlier-or-equal position."""
    schema = prompt.schema
    variants = scaffold_variants(prompt)
    index = {name: i for i, name in enumerate(prompt.modules)}
    scope = torch.zeros(len(index), len(index), dtype=torch.bool)
    for name, i in index.items():
        for other in module_scope(schema, name, variants.get(name, "")):
            if other in index:
                scope[i, index[other]] = True
    tokens: list[int] = []
    positions: list[int] = []
    live: list[bool] = []
    owner: list[int] = []
    for seg in prompt.segments:
        module_owned = seg.kind in ("cached", "slot")
        tokens.extend(seg.token_ids)
        positions.extend(seg.position_ids)
        live.extend([seg.kind != "slot"] * len(seg.token_ids))
        owner.extend([index[seg.module] if module_owned else -1] * len(seg.token_ids))
    pos = torch.tensor(positions, dtype=torch.long)
    own = torch.tensor(owner, dtype=torch.long)
    live_t = torch.tensor(live, dtype=torch.bool)
    causal = pos[None, :] <= pos[:, None]
    is_module = own >= 0
    safe = own.clamp(min=0)
    in_scope = scope[safe[:, None], safe[None, :]] & is_module[:, None] & is_module[None, :]
    uncached_view = (~is_module)[:, None] & live_t[None, :]
    return ReferencePlan(tokens, positions, live, causal & (in_scope | uncached_view))
