"""A frozen copy of the straightforward per-token planning code (main at d0718b7, before issue 41's
per-module caching): the oracle ``tests/test_plan_cache.py`` compares the planning code against.

Each function here walks every token of every imported module, as the code did then: slow, but
plainly right and now fixed. Do not "optimise" it; it is the reference.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from pckernels.engine.plan import BlockRef, ReferencePlan, RequestPlan
from pckernels.pml.model import ROOT, Module, ResolvedPrompt, Schema, Segment


# ----------------------------------------------------------------------------- pml/prompt.py

def _module_segments(module: Module, arguments: dict[tuple[str, str], tuple[int, ...]]
                     ) -> list[Segment]:
    """Cached runs, slots and arguments of one imported module. An uncached module
    (``cache="false"``) gives ``text`` runs and its arguments, and no slots: nothing cached
    needs placeholders."""
    out: list[Segment] = []
    slots = {p.offset: p for p in module.params}
    tokens, positions = module.token_ids, module.position_ids
    kind = "cached" if module.cached else "text"
    run_start = 0

    def flush(end: int) -> None:
        if end > run_start:
            out.append(Segment(kind, tokens[run_start:end], positions[run_start:end],
                               module=module.name))

    index = 0
    while index < len(tokens):
        param = slots.get(index)
        if param is not None:
            flush(index)
            end = index + param.length
            if module.cached:
                out.append(Segment("slot", tokens[index:end], positions[index:end],
                                   module=module.name, param=param.name))
            argument = arguments[(module.name, param.name)]
            if argument:
                out.append(Segment("argument", argument,
                                   tuple(range(param.start, param.start + len(argument))),
                                   module=module.name, param=param.name))
            index = end
            run_start = index
            continue
        if index > run_start and positions[index] != positions[index - 1] + 1:
            flush(index)
            run_start = index
        index += 1
    flush(len(tokens))
    return out


# ----------------------------------------------------------------------------- pml/placement.py


def top_module(schema: Schema, module: str) -> str:
    """The top-level module holding ``module`` (itself when top-level; ``ROOT`` for the root)."""
    modules = schema.modules
    name = module
    while name != ROOT and modules[name].parent not in (None, ROOT):
        name = modules[name].parent
    return name


def top_scaffold_members(schema: Schema, scaffold: str) -> tuple[str, ...]:
    """The members of ``scaffold`` when it sits at schema level (its members are top-level), else ()."""
    members = schema.scaffolds[scaffold].members
    return members if schema.modules[members[0]].parent == ROOT else ()


def unit_span(schema: Schema, module: str, scaffold: str = "") -> tuple[int, int]:
    """``(start, end)`` schema positions of the unit ``module`` moves with: its top-level module's
    span, or the span of a top-level ``scaffold``'s members when it is encoded within one."""
    members = top_scaffold_members(schema, scaffold) if scaffold else ()
    tops = members or (top_module(schema, module),)
    mods = [schema.modules[m] for m in tops]
    return min(m.start for m in mods), max(m.start + m.length for m in mods)


def root_before(schema: Schema, position: int) -> int:
    """How many of the root's own tokens lie before schema position ``position``."""
    return bisect_left(schema.modules[ROOT].position_ids, position)


def packed_shift(schema: Schema, module: str, scaffold: str = "") -> int:
    """Shift from schema positions to ``module``'s packed encoding: its unit starts right after
    the last anonymous token before it (at 0 when there is none). The root never moves."""
    if module == ROOT:
        return 0
    start, _ = unit_span(schema, module, scaffold)
    count = root_before(schema, start)
    first = schema.modules[ROOT].position_ids[count - 1] + 1 if count else 0
    return first - start


def encoded_positions(schema: Schema, module: str, geometry: str = "schema", scaffold: str = "") -> tuple[int, ...]:
    """Positions of ``module``'s own tokens in its ``geometry`` encoding."""
    positions = schema.modules[module].position_ids
    if geometry == "schema":
        return positions
    shift = packed_shift(schema, module, scaffold)
    return tuple(p + shift for p in positions)


@dataclass
class Layout:
    """A compact layout: ``segments`` sorted by position, ``positions[module]`` the prompt
    positions of each imported module's own tokens, ``geometry[module]`` the encoding it is read
    from, and ``end`` the first position after the prompt."""

    segments: list[Segment]
    positions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    geometry: dict[str, str] = field(default_factory=dict)
    end: int = 0


@dataclass
class _Unit:
    modules: list[str]
    start: int
    end: int
    rank: int
    scaffold: str = ""
    segments: list[Segment] = field(default_factory=list)
    texts: list[Segment] = field(default_factory=list)


def compact_layout(schema: Schema, imported: list[str], scaffolds: tuple[str, ...], module_segments: list[Segment],
                   texts: list[tuple[str | None, Segment]], trailing: list[Segment], order: list[str]) -> Layout:
    """Lay a resolved prompt out compactly (see the module docstring).

    ``module_segments``: the imported modules' segments at schema positions (cached, slot,
    argument, and ``text`` of uncached modules); ``texts``: text written before or between
    imports with the module of the import written before it (``None``: before any import);
    ``trailing``: text after the last import; ``order``: modules in the order the prompt imports
    them. Text segments come with any positions (they are replaced).
    """
    modules = schema.modules
    unit_of: dict[str, _Unit] = {}
    units: list[_Unit] = []
    rank = {name: i for i, name in reversed(list(enumerate(order)))}
    for name in scaffolds:
        members = top_scaffold_members(schema, name)
        if members:
            start, end = unit_span(schema, members[0], name)
            unit = _Unit(list(members), start, end, min(rank.get(m, len(order)) for m in members), name)
            units.append(unit)
            unit_of.update((m, unit) for m in members)
    for name in imported:
        if name == ROOT:
            continue
        top = top_module(schema, name)
        unit = unit_of.get(top)
        if unit is None:
            mod = modules[top]
            unit = _Unit([top], mod.start, mod.start + mod.length, len(order))
            units.append(unit)
            unit_of[top] = unit
        unit_of[name] = unit
        unit.rank = min(unit.rank, rank.get(name, len(order)))
    root_segments = []
    for seg in module_segments:
        if seg.module == ROOT:
            root_segments.append(seg)
        else:
            unit_of[seg.module].segments.append(seg)
    head: list[Segment] = []
    for after, seg in texts:
        (head if after is None else unit_of[after].texts).append(seg)

    slots = sorted(units, key=lambda u: u.start)
    filled = sorted(units, key=lambda u: (u.rank, u.start))
    events = sorted([(seg.position_ids[0], 0, seg) for seg in root_segments]
                    + [(u.start, 1, i) for i, u in enumerate(slots)], key=lambda e: (e[0], e[1]))
    layout = Layout([])
    shifts: dict[int, int] = {}
    cursor = 0
    root_rows: list[tuple[int, int]] = []
    """(schema position of a root run's last token, its prompt position), in schema order."""

    def text(seg: Segment) -> None:
        nonlocal cursor
        if not seg.token_ids:
            return
        layout.segments.append(Segment("text", seg.token_ids, tuple(range(cursor, cursor + len(seg.token_ids))),
                                       module=seg.module, param=seg.param))
        cursor += len(seg.token_ids)

    placed_head = False
    for position, kind, item in events:
        if kind == 0:
            n = len(item.token_ids)
            shift = cursor - position
            for p in item.position_ids:
                shifts[p] = shift
            layout.segments.append(Segment(item.kind, item.token_ids, tuple(range(cursor, cursor + n)),
                                           module=ROOT))
            root_rows.append((item.position_ids[-1], cursor + n - 1))
            cursor += n
            continue
        if not placed_head:
            for seg in head:
                text(seg)
            placed_head = True
        unit = filled[item]
        shift = cursor - unit.start
        for seg in unit.segments:
            layout.segments.append(Segment(seg.kind, seg.token_ids, tuple(p + shift for p in seg.position_ids),
                                           module=seg.module, param=seg.param))
        geometry = _nearest_geometry(schema, unit.start, cursor, root_rows[-1] if root_rows else None)
        for name in imported:
            if name != ROOT and unit_of[name] is unit:
                layout.positions[name] = tuple(p + shift for p in modules[name].position_ids)
                layout.geometry[name] = geometry
        cursor += unit.end - unit.start
        for seg in unit.texts:
            text(seg)
    if not placed_head:
        for seg in head:
            text(seg)
    for seg in trailing:
        text(seg)
    root = modules[ROOT]
    layout.positions[ROOT] = tuple(p + shifts[p] for p in root.position_ids)
    layout.geometry[ROOT] = "schema"
    layout.segments.sort(key=lambda s: (s.position_ids[0] if s.position_ids else cursor, s.kind == "argument"))
    layout.end = cursor
    return layout


def _nearest_geometry(schema: Schema, start: int, at: int, last_root: tuple[int, int] | None) -> str:
    """The encoding of a unit starting at schema position ``start`` and prompt position ``at``
    whose distance to the anonymous text before it is nearest the distance it gets in the prompt
    (to ``last_root``, the last anonymous token placed before it: ``(schema, prompt)`` position);
    ties, and units with no anonymous text before them, read the schema encoding."""
    count = root_before(schema, start)
    if not count or last_root is None:
        return "schema"
    wanted = at - last_root[1] - 1
    in_schema = start - schema.modules[ROOT].position_ids[count - 1] - 1
    return "packed" if abs(wanted) < abs(wanted - in_schema) else "schema"


# ----------------------------------------------------------------------------- engine/plan.py


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

