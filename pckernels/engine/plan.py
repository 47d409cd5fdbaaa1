"""From a resolved prompt to what the engine needs: which cached blocks a request reads (and which
of their rows it must not see), which tokens it computes; the module-scoped mask of the oracle;
which stale tokens to recompute."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from pckernels.pml.model import ResolvedPrompt, Schema, ShiftRuns
from pckernels.pml.placement import encoded_shift


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


TokenRef = tuple[str, int]
"""A module's own token: ``(module, index into Module.token_ids)``."""

RECOMPUTE_POLICIES = ("first", "deviation", "epic")


IndexRuns = list[tuple[int, int]]
"""Runs ``(first, stop)`` of a module's own-token indices, in order."""


def block_shift_runs(prompt: ResolvedPrompt, module: str, scaffold: str = "") -> ShiftRuns:
    """Runs ``(first, stop, delta)`` covering ``module``'s own tokens: each token's position in
    ``prompt`` minus the position it was encoded at (in the encoding the prompt reads it from); one
    run per rigid move (a non-root module moves whole), all 0 at schema placement."""
    if prompt.placement == "schema":
        n = len(prompt.schema.modules[module].token_ids)
        return ((0, n, 0),) if n else ()
    encoded = encoded_shift(prompt.schema, module, prompt.geometry_of(module), scaffold)
    runs: list[tuple[int, int, int]] = []
    for first, stop, shift in prompt.own_shifts(module):
        delta = shift - encoded
        if runs and runs[-1][1] == first and runs[-1][2] == delta:
            runs[-1] = (runs[-1][0], stop, delta)
        elif stop > first:
            runs.append((first, stop, delta))
    return tuple(runs)


def moving(runs: ShiftRuns) -> ShiftRuns:
    """``runs`` when some token moves, else ``()`` (what :attr:`BlockRef.shifts` holds)."""
    return runs if any(delta for _, _, delta in runs) else ()


def _moved_runs(prompt: ResolvedPrompt, variants: dict[str, str]) -> dict[str, IndexRuns]:
    """``module -> runs`` of its cached tokens whose encoding context sits at another distance in
    ``prompt``: some token of their scope they attended while encoded (at an earlier-or-equal encoded
    position) moved by a different shift. A module moved whole keeps its own and its
    ancestors-within-the-unit's distances (re-rotation is exact for them); the anonymous text before
    it may not. Within a run of one shift the moved tokens are a suffix (encoded positions grow with
    the index), so this costs a few bisections per run, not a pass over the tokens."""
    if prompt.placement == "schema":
        return {}
    schema = prompt.schema
    imported = set(prompt.modules)
    blocks: dict[str, tuple[ShiftRuns, int]] = {}
    """module -> (its delta runs, the shift from its schema positions to its encoded ones)."""
    for name in prompt.modules:
        if schema.modules[name].cached:
            scaffold = variants.get(name, "")
            blocks[name] = (block_shift_runs(prompt, name, scaffold),
                            encoded_shift(schema, name, prompt.geometry_of(name), scaffold))
    firsts: dict[tuple[str, int], int] = {}

    def first_moved_otherwise(other: str, delta: int) -> int:
        """The earliest encoded position of ``other``'s tokens moved by another delta (-1: none)."""
        if (other, delta) not in firsts:
            runs, encoded = blocks[other]
            first = next((f for f, _, d in runs if d != delta), None)
            firsts[other, delta] = -1 if first is None else schema.modules[other].position_ids[first] + encoded
        return firsts[other, delta]

    moved: dict[str, IndexRuns] = {}
    for name, (runs, encoded) in blocks.items():
        scope = [m for m in module_scope(schema, name, variants.get(name, "")) if m in imported and m in blocks]
        positions = schema.modules[name].position_ids
        out: IndexRuns = []
        for first, stop, delta in runs:
            start = stop
            for other in scope:
                position = first_moved_otherwise(other, delta)
                if position >= 0:
                    start = min(start, bisect_left(positions, position - encoded, first, stop))
            if start < stop:
                out.append((start, stop))
        if out:
            moved[name] = out
    return moved


def _moved_tokens(prompt: ResolvedPrompt, variants: dict[str, str]) -> set[TokenRef]:
    """The tokens of :func:`_moved_runs`, one by one."""
    return {(name, i) for name, runs in _moved_runs(prompt, variants).items() for a, b in runs for i in range(a, b)}


def _first_in(runs: IndexRuns, first: int, stop: int) -> int:
    """The first index of ``first .. stop - 1`` inside ``runs`` (``stop`` when none is)."""
    for a, b in runs:
        if b > first and a < stop:
            return max(a, first)
    return stop


def stale_runs(prompt: ResolvedPrompt) -> list[tuple[str, int, int]]:
    """:func:`stale_tokens` as runs ``(module, first, stop)`` of own-token indices, in position order.

    Within a cached segment the rule is decided at its first token and at its first moved token:
    once a token of a module is stale, every later token of its scope is."""
    schema = prompt.schema
    variants = scaffold_variants(prompt)
    moved = _moved_runs(prompt, variants)
    seen: set[str | None] = set()
    stale_owners: set[str] = set()
    stale: list[tuple[str, int, int]] = []
    for seg in prompt.segments:
        if seg.kind == "slot":
            continue
        if seg.kind != "cached":
            seen.add(None)
            continue
        scope = module_scope(schema, seg.module, variants.get(seg.module, ""))
        first = prompt.own_index(seg.module, seg.position_ids[0])
        stop = first + len(seg.position_ids)
        if not seen <= scope or stale_owners & scope:
            start = first
        else:
            start = _first_in(moved.get(seg.module, []), first, stop)
        if start < stop:
            stale.append((seg.module, start, stop))
            stale_owners.add(seg.module)
        seen.add(seg.module)
    return stale


def stale_tokens(prompt: ResolvedPrompt) -> list[TokenRef]:
    """Cached tokens of ``prompt`` whose states differ from what full causal attention over the
    prompt would give, in position order: a token is stale when an earlier live token of the
    prompt lies outside its encoding scope, or an earlier token in its scope is stale, or (compact
    placement) a token of its scope it was encoded against moved by another distance. The others
    (the system prompt, the first module after it) are already exact; recomputing them changes
    nothing. Parameter placeholders are never live, so never stale."""
    return [(module, i) for module, first, stop in stale_runs(prompt) for i in range(first, stop)]


def last_cached_token(prompt: ResolvedPrompt) -> TokenRef | None:
    """The prompt's last token (highest position) when it is cached — a prompt that ends with an
    import, e.g. to continue a document — else None. Its stored states were encoded without the
    rest of the prompt and give no logits, so the request computes it afresh over every earlier
    live token (a recomputed token: its cached row hidden, a fresh row of its own), the reference
    forward likewise."""
    live = prompt.live_segments()
    if not live:
        return None
    last = max(live, key=lambda seg: seg.position_ids[-1])
    if last.kind != "cached":
        return None
    return last.module, prompt.own_index(last.module, last.position_ids[-1])


DEFAULT_RECOMPUTE = {"compact": (8, "epic"), "schema": (0.0, "first")}
"""What a request recomputes unless it says (``recompute=None``), by its prompt's placement:
the first 8 stale tokens of every module when placed compactly (``compact+epic@8``, chosen on
the fidelity suite's dev set and held on its held-out set, ``docs/fidelity.md``), nothing at
schema placement (the paper's semantics, equal to the reference forward)."""


def default_recompute(placement: str, recompute: float | None, policy: str | None) -> tuple[float, str]:
    """``(recompute, policy)`` for a request: what it asked for, the ``epic`` count 8 when it
    names only that policy, else :data:`DEFAULT_RECOMPUTE` for ``placement``."""
    if recompute is None:
        if policy is None:
            return DEFAULT_RECOMPUTE[placement]
        if policy == "epic":
            return DEFAULT_RECOMPUTE["compact"][0], policy
        if policy in RECOMPUTE_POLICIES:
            raise ValueError(f"recompute_policy={policy!r} needs recompute= (a share between 0 and 1)")
    return (0.0 if recompute is None else recompute), policy or "first"


def select_recompute(prompt: ResolvedPrompt, share: float, policy: str = "first",
                     scores: Callable[[], Mapping[str, Sequence[float]]] | None = None) -> frozenset[TokenRef]:
    """The prompt's stale tokens to compute afresh: a ``share`` (0 to 1) of them, or with
    ``epic`` ``share`` tokens per module.

    ``first``: the first ``ceil(share * n)`` stale tokens of each module (``n`` its stale
    tokens). ``deviation``: the ``ceil(share * N)`` stale tokens of the whole prompt with the
    highest ``scores()[module][index]`` (earlier positions win ties); ``scores`` is called only
    when that policy needs it. ``epic`` (EPIC's recompute of each chunk's opening): the first
    ``k = share`` stale tokens of each placed module, an integer count whatever the module's size.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; expected one of {', '.join(RECOMPUTE_POLICIES)}")
    if policy == "epic":
        if share < 0 or share != int(share):
            raise ValueError(f"recompute with the epic policy is a count of tokens per module (an integer >= 0), "
                             f"got {share}")
    elif not 0.0 <= share <= 1.0:
        raise ValueError(f"recompute must be a share between 0 and 1, got {share}")
    runs = stale_runs(prompt) if share else []
    if not runs:
        return frozenset()
    if policy in ("first", "epic"):
        by_module: dict[str, IndexRuns] = {}
        for module, first, stop in runs:
            by_module.setdefault(module, []).append((first, stop))
        count = (lambda n: min(n, int(share))) if policy == "epic" else (lambda n: _share_count(share, n))
        chosen: list[TokenRef] = []
        for module, spans in by_module.items():
            left = count(sum(stop - first for first, stop in spans))
            for first, stop in spans:
                if left <= 0:
                    break
                take = min(left, stop - first)
                chosen.extend((module, i) for i in range(first, first + take))
                left -= take
        return frozenset(chosen)
    if scores is None:
        raise ValueError("the deviation policy needs per-token deviation scores")
    stale = [(module, i) for module, first, stop in runs for i in range(first, stop)]
    table = scores()
    order = sorted(range(len(stale)), key=lambda i: (-float(table[stale[i][0]][stale[i][1]]), i))
    return frozenset(stale[i] for i in order[:_share_count(share, len(stale))])


def _share_count(share: float, n: int) -> int:
    return min(n, math.ceil(share * n - 1e-9))


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
            first = prompt.own_index(seg.module, seg.position_ids[0])
            for offset, (token, position) in enumerate(zip(seg.token_ids, seg.position_ids)):
                fresh = (seg.module, first + offset) in recompute
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


@dataclass(frozen=True)
class BlockRef:
    """An imported module's block as one request uses it: ``hidden`` lists the block rows (own
    token indices) the request must not see — parameter slots, whose arguments it computes in
    rows of its own, and recomputed tokens, whose fresh states replace the cached ones.
    ``geometry``: which encoding of the block (``"schema"`` or ``"packed"``); ``shifts``: runs
    ``(first, stop, delta)`` of own-token indices moved by ``delta`` positions from where they were
    encoded (compact placement; ``()``: none move)."""

    module: str
    scaffold: str
    n_rows: int
    hidden: tuple[int, ...] = ()
    geometry: str = "schema"
    shifts: tuple[tuple[int, int, int], ...] = ()


@dataclass
class RequestPlan:
    """What the batch engine needs for one request: shared blocks to place (once per arena) and
    the request's own new tokens in position order.

    ``prefill_mask`` (reference mode) is the boolean ``[n, n]`` visibility among the new tokens,
    used instead of causality by position; ``live`` marks which new tokens later tokens (decoding)
    may see (``None``: all).
    """

    blocks: list[BlockRef]
    new_tokens: list[int]
    new_positions: list[int]
    cached_tokens: int
    live: list[bool] | None = None
    prefill_mask: torch.Tensor | None = None


def plan_request(prompt: ResolvedPrompt, recompute: frozenset[TokenRef] = frozenset()) -> RequestPlan:
    """The shared-block plan of ``prompt`` in cached mode: each imported cached module's block is
    placed as encoded, or moved where a compact prompt puts it (slots and recomputed tokens hidden
    for this request); arguments, text and recomputed tokens are new tokens at their positions. Attention by position over the
    visible rows then gives what :func:`plan_cached` gives with private rows."""
    schema = prompt.schema
    variants = scaffold_variants(prompt)
    recomputed: dict[str, set[int]] = {}
    for module, index in recompute:
        recomputed.setdefault(module, set()).add(index)
    blocks: list[BlockRef] = []
    cached_tokens = 0
    for name in prompt.modules:
        module = schema.modules[name]
        if not module.cached:
            continue
        hidden = set(recomputed.get(name, ()))
        for param in module.params:
            hidden.update(range(param.offset, param.offset + param.length))
        n = len(module.token_ids)
        scaffold = variants.get(name, "")
        blocks.append(BlockRef(name, scaffold, n, tuple(sorted(hidden)), prompt.geometry_of(name),
                               moving(block_shift_runs(prompt, name, scaffold))))
        cached_tokens += n - len(hidden)
    wanted = {module: sorted(indices) for module, indices in recomputed.items()}
    tokens: list[int] = []
    positions: list[int] = []
    for seg in prompt.segments:
        if seg.kind in ("argument", "text"):
            tokens.extend(seg.token_ids)
            positions.extend(seg.position_ids)
        elif seg.kind == "cached" and seg.module in recomputed:
            first = prompt.own_index(seg.module, seg.position_ids[0])
            indices = wanted[seg.module]
            for i in indices[bisect_left(indices, first):bisect_left(indices, first + len(seg.token_ids))]:
                tokens.append(seg.token_ids[i - first])
                positions.append(seg.position_ids[i - first])
    if not tokens:  # the engine answers from the last computed token; callers add it (last_cached_token)
        raise ValueError("a cached request must compute at least one token")
    return RequestPlan(blocks, tokens, positions, cached_tokens)


def plan_request_reference(prompt: ResolvedPrompt, recompute: frozenset[TokenRef] = frozenset()) -> RequestPlan:
    """The oracle as a request: every token computed, with :func:`plan_reference`'s mask."""
    ref = plan_reference(prompt, recompute)
    return RequestPlan([], ref.tokens, ref.positions, 0, live=ref.live, prefill_mask=ref.mask)


def plan_request_baseline(prompt: ResolvedPrompt) -> RequestPlan:
    """No reuse: the prompt's tokens at contiguous positions, causal attention."""
    tokens = list(prompt.token_ids)
    return RequestPlan([], tokens, list(range(len(tokens))), 0)
