"""From a resolved prompt to what the engine needs: which cached blocks a request reads (and which
of their rows it must not see), which tokens it computes; the module-scoped mask of the oracle;
which stale tokens to recompute."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from pckernels.pml.model import ResolvedPrompt, Schema
from pckernels.pml.placement import encoded_positions


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


def _own_index(prompt: ResolvedPrompt, module: str) -> dict[int, int]:
    """``position -> index`` of a module's own tokens where ``prompt`` places them."""
    return {p: i for i, p in enumerate(prompt.own_positions(module))}


def block_shifts(prompt: ResolvedPrompt, module: str, scaffold: str = "") -> list[int]:
    """Per own token of ``module``: its position in ``prompt`` minus the position it was encoded
    at (in the encoding the prompt reads it from); all 0 at schema placement."""
    if prompt.placement == "schema":
        return [0] * len(prompt.schema.modules[module].token_ids)
    encoded = encoded_positions(prompt.schema, module, prompt.geometry_of(module), scaffold)
    return [p - e for p, e in zip(prompt.own_positions(module), encoded)]


def shift_runs(shifts: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Runs ``(first, stop, shift)`` of equal shifts over own-token indices; ``()`` when all are 0."""
    if not any(shifts):
        return ()
    runs: list[tuple[int, int, int]] = []
    for i, shift in enumerate(shifts):
        if runs and runs[-1][2] == shift:
            runs[-1] = (runs[-1][0], i + 1, shift)
        else:
            runs.append((i, i + 1, shift))
    return tuple(runs)


def _moved_tokens(prompt: ResolvedPrompt, variants: dict[str, str]) -> set[TokenRef]:
    """Cached tokens whose encoding context sits at another distance in ``prompt``: some token of
    their scope they attended while encoded (at an earlier-or-equal encoded position) moved by a
    different shift. A module moved whole keeps its own and its ancestors-within-the-unit's
    distances (re-rotation is exact for them); the anonymous text before it may not."""
    if prompt.placement == "schema":
        return set()
    schema = prompt.schema
    imported = set(prompt.modules)
    firsts: dict[str, dict[int, int]] = {}
    """module -> shift -> the earliest encoded position of its tokens moved by another shift."""
    encoded: dict[str, tuple[int, ...]] = {}
    shifts: dict[str, list[int]] = {}
    for name in prompt.modules:
        if not schema.modules[name].cached:
            continue
        scaffold = variants.get(name, "")
        encoded[name] = encoded_positions(schema, name, prompt.geometry_of(name), scaffold)
        shifts[name] = block_shifts(prompt, name, scaffold)
        firsts[name] = {}
    moved: set[TokenRef] = set()
    for name, positions in encoded.items():
        scope = [m for m in module_scope(schema, name, variants.get(name, "")) if m in imported and m in encoded]
        for index, (position, shift) in enumerate(zip(positions, shifts[name])):
            for other in scope:
                if shift not in firsts[other]:
                    firsts[other][shift] = min((e for e, s in zip(encoded[other], shifts[other]) if s != shift),
                                               default=-1)
                first = firsts[other][shift]
                if 0 <= first <= position:
                    moved.add((name, index))
                    break
    return moved


def stale_tokens(prompt: ResolvedPrompt) -> list[TokenRef]:
    """Cached tokens of ``prompt`` whose states differ from what full causal attention over the
    prompt would give, in position order: a token is stale when an earlier live token of the
    prompt lies outside its encoding scope, or an earlier token in its scope is stale, or (compact
    placement) a token of its scope it was encoded against moved by another distance. The others
    (the system prompt, the first module after it) are already exact; recomputing them changes
    nothing. Parameter placeholders are never live, so never stale."""
    schema = prompt.schema
    variants = scaffold_variants(prompt)
    moved = _moved_tokens(prompt, variants)
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
        index = _own_index(prompt, seg.module)
        for position in seg.position_ids:
            ref = (seg.module, index[position])
            if not seen <= scope or stale_owners & scope or ref in moved:
                stale.append(ref)
                stale_owners.add(seg.module)
            seen.add(seg.module)
    return stale


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
    position = last.position_ids[-1]
    return last.module, _own_index(prompt, last.module)[position]


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
    stale = stale_tokens(prompt) if share else []
    if not stale:
        return frozenset()
    if policy in ("first", "epic"):
        by_module: dict[str, list[TokenRef]] = {}
        for ref in stale:
            by_module.setdefault(ref[0], []).append(ref)
        count = (lambda n: min(n, int(share))) if policy == "epic" else (lambda n: _share_count(share, n))
        return frozenset(ref for refs in by_module.values() for ref in refs[:count(len(refs))])
    if scores is None:
        raise ValueError("the deviation policy needs per-token deviation scores")
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
            own = _own_index(prompt, seg.module)
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
                               shift_runs(block_shifts(prompt, name, scaffold))))
        cached_tokens += n - len(hidden)
    tokens: list[int] = []
    positions: list[int] = []
    for seg in prompt.segments:
        if seg.kind in ("argument", "text"):
            tokens.extend(seg.token_ids)
            positions.extend(seg.position_ids)
        elif seg.kind == "cached" and seg.module in recomputed:
            index = _own_index(prompt, seg.module)
            for token, position in zip(seg.token_ids, seg.position_ids):
                if index[position] in recomputed[seg.module]:
                    tokens.append(token)
                    positions.append(position)
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
