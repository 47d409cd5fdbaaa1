"""From a resolved prompt to what the forward needs: which cached blocks go to which rows,
which rows are computed fresh, which are dead; and the module-scoped mask of the oracle."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from pckernels.pml.model import ResolvedPrompt, Schema


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
    ``new_tokens/new_positions/new_rows``: tokens computed by the forward (arguments, text and
    recomputed module tokens) in position order.
    ``dead_rows``: unused parameter-slot rows. ``rows``: rows in use after the prompt.
    """

    blocks: list[BlockUse]
    new_tokens: list[int]
    new_positions: list[int]
    new_rows: list[int]
    dead_rows: list[int]
    rows: int
    cached_tokens: int
    recomputed_blocks: frozenset[str] = frozenset()
    """Modules some of whose rows are overwritten by recomputed tokens."""

    @property
    def new_rows_contiguous(self) -> bool:
        rows = self.new_rows
        return not rows or rows == list(range(rows[0], rows[0] + len(rows)))

    @property
    def overwritten_spans(self) -> list[tuple[int, int]]:
        """Row ranges ``[start, stop)`` the forward writes: whole blocks holding recomputed rows
        (so a later prompt copies them afresh in one piece) and runs of the other new rows."""
        whole = [(b.dst_row, b.dst_row + b.n_rows) for b in self.blocks if b.module in self.recomputed_blocks]
        runs: list[tuple[int, int]] = []
        for row in sorted(r for r in self.new_rows if not any(lo <= r < hi for lo, hi in whole)):
            if runs and runs[-1][1] == row:
                runs[-1] = (runs[-1][0], row + 1)
            else:
                runs.append((row, row + 1))
        return sorted(whole + runs)


TokenRef = tuple[str, int]
"""A module's own token: ``(module, index into Module.token_ids)``."""

RECOMPUTE_POLICIES = ("first", "deviation")


def _own_index(schema: Schema, module: str) -> dict[int, int]:
    """``position -> index`` of a module's own tokens."""
    return {p: i for i, p in enumerate(schema.modules[module].position_ids)}


def stale_tokens(prompt: ResolvedPrompt) -> list[TokenRef]:
    """Cached tokens of ``prompt`` whose states differ from what full causal attention over the
    prompt would give, in position order: a token is stale when an earlier live token of the
    prompt lies outside its encoding scope, or an earlier token in its scope is stale. The others
    (the system prompt, the first module after it) are already exact; recomputing them changes
    nothing. Parameter placeholders are never live, so never stale."""
    schema = prompt.schema
    variants = scaffold_variants(prompt)
    seen: set[str | None] = set()
    stale_owners: set[str] = set()
    stale: list[TokenRef] = []
    for seg in prompt.segments:
        if seg.kind == "slot":
            continue
        if seg.kind != "cached":
            seen.add(None)
            continue
        scope = module_scope(schema, seg.module, variants.get(seg.module, ""))
        index = _own_index(schema, seg.module)
        for position in seg.position_ids:
            if not seen <= scope or stale_owners & scope:
                stale.append((seg.module, index[position]))
                stale_owners.add(seg.module)
            seen.add(seg.module)
    return stale


def select_recompute(prompt: ResolvedPrompt, share: float, policy: str = "first",
                     scores: Callable[[], Mapping[str, Sequence[float]]] | None = None) -> frozenset[TokenRef]:
    """The ``share`` (0 to 1) of the prompt's stale tokens to compute afresh.

    ``first``: the first ``ceil(share * n)`` stale tokens of each module (``n`` its stale
    tokens). ``deviation``: the ``ceil(share * N)`` stale tokens of the whole prompt with the
    highest ``scores()[module][index]`` (earlier positions win ties); ``scores`` is called only
    when that policy needs it.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"recompute must be a share between 0 and 1, got {share}")
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; expected one of {', '.join(RECOMPUTE_POLICIES)}")
    stale = stale_tokens(prompt) if share else []
    if not stale:
        return frozenset()
    if policy == "first":
        by_module: dict[str, list[TokenRef]] = {}
        for ref in stale:
            by_module.setdefault(ref[0], []).append(ref)
        return frozenset(ref for refs in by_module.values() for ref in refs[:_share_count(share, len(refs))])
    if scores is None:
        raise ValueError("the deviation policy needs per-token deviation scores")
    table = scores()
    order = sorted(range(len(stale)), key=lambda i: (-float(table[stale[i][0]][stale[i][1]]), i))
    return frozenset(stale[i] for i in order[:_share_count(share, len(stale))])


def _share_count(share: float, n: int) -> int:
    return min(n, math.ceil(share * n - 1e-9))


def plan_cached(prompt: ResolvedPrompt, recompute: frozenset[TokenRef] = frozenset()) -> CachedPlan:
    """Lay the prompt's imported blocks out contiguously in document order, arguments at
    their slots' rows, uncached text after the blocks. Uncached modules (``cache="false"``)
    have no block: their tokens and arguments are text. Tokens in ``recompute`` are computed
    like uncached ones at their block rows, their fresh states replacing the cached ones."""
    schema = prompt.schema
    variants = scaffold_variants(prompt)
    blocks: list[BlockUse] = []
    block_row: dict[str, int] = {}
    row = 0
    for name in prompt.modules:
        if not schema.modules[name].cached:
            continue
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
        if module_name not in block_row:
            continue
        param = _param(schema, module_name, param_name)
        arg = prompt.arguments[(module_name, param_name)]
        slot_row = block_row[module_name] + param.offset
        dead_rows.extend(range(slot_row + len(arg), slot_row + param.length))
        cached_tokens -= param.length
    text_row = row
    recomputed_modules = {module for module, _ in recompute}
    for seg in prompt.segments:
        token_ids, position_ids = seg.token_ids, seg.position_ids
        if seg.kind == "argument" and seg.module in block_row:
            param = _param(schema, seg.module, seg.param)
            slot_row = block_row[seg.module] + param.offset
            rows = [slot_row + (p - param.start) for p in position_ids]
        elif seg.kind in ("text", "argument"):
            rows = list(range(text_row, text_row + len(token_ids)))
            text_row += len(token_ids)
        elif seg.kind == "cached" and seg.module in recomputed_modules:
            index = _own_index(schema, seg.module)
            fresh = [(t, p, block_row[seg.module] + index[p]) for t, p in zip(token_ids, position_ids)
                     if (seg.module, index[p]) in recompute]
            if not fresh:
                continue
            token_ids, position_ids, rows = (list(column) for column in zip(*fresh))
        else:
            continue
        new_tokens.extend(token_ids)
        new_positions.extend(position_ids)
        new_rows.extend(rows)
    return CachedPlan(blocks, new_tokens, new_positions, new_rows, sorted(dead_rows), text_row,
                      cached_tokens - len(recompute), frozenset(recomputed_modules))


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


def plan_reference(prompt: ResolvedPrompt, recompute: frozenset[TokenRef] = frozenset()) -> ReferencePlan:
    """Module tokens see the own tokens of their scope at earlier-or-equal positions;
    uncached tokens see every live token at an earlier-or-equal position.

    A token in ``recompute`` appears twice: as a module token that is not live (what the other
    tokens of its scope were encoded against) and, right after it, as an uncached token that
    is (what the prompt's later uncached and recomputed tokens, and decoding, see)."""
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
    recomputed_modules = {module for module, _ in recompute}
    for seg in prompt.segments:
        if seg.kind == "cached" and seg.module in recomputed_modules:
            own = _own_index(schema, seg.module)
            for token, position in zip(seg.token_ids, seg.position_ids):
                fresh = (seg.module, own[position]) in recompute
                tokens.append(token)
                positions.append(position)
                live.append(not fresh)
                owner.append(index[seg.module])
                if fresh:
                    tokens.append(token)
                    positions.append(position)
                    live.append(True)
                    owner.append(-1)
            continue
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
