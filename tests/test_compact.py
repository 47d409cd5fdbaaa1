"""Compact placement: modules laid out contiguously in the prompt's order, keys re-rotated while placed.

The oracle is the reference forward at the compact positions with the same module-scoped mask.
Re-rotation is exact (fp32 first logits within ``FP32_TOL``, identical greedy tokens) whenever no
cached token's encoding context moved by another distance (``_moved_tokens`` is empty: a module's
own tokens, its ancestors inside its unit, and anonymous text that kept its distance); otherwise
cached differs from the reference by the changed distance, and recomputing every stale token
(``recompute=1.0``) makes it exact again — a full causal forward at the compact positions.
A tiny random Llama (GQA) with the embedded SmolLM2 tokenizer, as in ``test_engine``. Requests
here say ``recompute=0`` (or the amount they test): compact prompts otherwise get the engine's
default epic@8 recompute (``test_defaults``).
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from test_engine import FP32_TOL, NEW_TOKENS, PROMPTS, SCHEMA, SHUFFLED, tiny_llama
from transformers import DynamicCache

from pckernels import PMLError
from pckernels.engine import PromptCache
from pckernels.engine.plan import _moved_tokens, scaffold_variants, select_recompute, stale_tokens
from pckernels.pml import parse_prompt, parse_schema
from pckernels.pml.placement import encoded_positions, packed_shift

OPEN = '<prompt schema="guide">'
COMPACT = '<prompt schema="guide" placement="compact">'
ALL_PROMPTS = {**PROMPTS, **{f"shuffled-{k}": v for k, v in SHUFFLED.items()}}


def compact(prompt: str) -> str:
    assert prompt.startswith(OPEN)
    return COMPACT + prompt[len(OPEN):]


@pytest.fixture(scope="module")
def tokenizer():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def cache(tokenizer):
    pc = PromptCache(tiny_llama(len(tokenizer), seed=5), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    return pc


def moved(pc: PromptCache, prompt: str) -> set:
    resolved = pc.resolve(prompt)
    return _moved_tokens(resolved, scaffold_variants(resolved))


EXACT = sorted(name for name in ALL_PROMPTS if name not in
               ("nested-some", "shuffled-everything", "shuffled-nested-some", "shuffled-text-between",
                "shuffled-scaffold-then-union"))


# ----------------------------------------------------------------------------- layout


def test_compact_layout_is_contiguous_in_prompt_order(tokenizer):
    schema = parse_schema(SCHEMA, tokenizer)
    got = parse_prompt(compact(SHUFFLED["everything"]), schema)
    assert got.placement == "compact"
    order = [seg.module for seg in got.segments if seg.kind == "cached"]
    firsts = list(dict.fromkeys(order))
    assert firsts == ["", "fact-a", "fact-b", "plan", "plan/budget", "plan/food", "tokyo", "intro"]
    positions = got.position_ids
    assert positions[0] == 0 and list(positions) == sorted(positions)
    holes = sum(b - a - 1 for a, b in itertools.pairwise(positions))
    unused = sum(p.length for m in ("plan", "plan/budget") for p in schema.modules[m].params) - sum(
        len(v) for (m, _), v in got.arguments.items() if m.startswith("plan"))
    assert holes == unused, "only the unused parameter room of a unit stays a gap"
    assert got.token_ids == tuple(t for seg in got.segments if seg.kind != "slot" for t in seg.token_ids)
    for name in got.modules:
        own = got.own_positions(name)
        assert len(own) == len(schema.modules[name].token_ids)
        if name:
            shift = {p - q for p, q in zip(own, schema.modules[name].position_ids)}
            assert len(shift) == 1, f"{name} moves rigidly"


def test_schema_placement_is_the_default_and_unchanged(tokenizer):
    schema = parse_schema(SCHEMA, tokenizer)
    for prompt in ALL_PROMPTS.values():
        plain = parse_prompt(prompt, schema)
        said = parse_prompt(prompt.replace(OPEN, '<prompt schema="guide" placement="schema">'), schema)
        assert plain.placement == said.placement == "schema"
        assert plain.segments == said.segments and not plain.module_positions


def test_schema_default_placement_and_override(tokenizer):
    text = SCHEMA.replace('<schema name="guide">', '<schema name="guide" placement="compact">')
    schema = parse_schema(text, tokenizer)
    assert schema.placement == "compact"
    assert parse_prompt(PROMPTS["other-member"], schema).placement == "compact"
    assert parse_prompt(PROMPTS["other-member"].replace(OPEN, '<prompt schema="guide" placement="schema">'),
                        schema).placement == "schema"


def test_text_between_imports_needs_no_room_when_compact(tokenizer):
    schema = parse_schema(SCHEMA, tokenizer)
    prompt = f'{OPEN}<intro/> Note this. <tokyo/><user>Go.</user><assistant/></prompt>'
    with pytest.raises(PMLError, match="needs .* positions"):
        parse_prompt(prompt, schema)
    got = parse_prompt(compact(prompt), schema)
    kinds = [(seg.kind, seg.module) for seg in got.segments]
    assert kinds.index(("cached", "intro")) < kinds.index(("text", None)) < kinds.index(("cached", "tokyo"))
    swapped = parse_prompt(compact(f'{OPEN}<tokyo/> Note this. <intro/><user>Go.</user><assistant/></prompt>'),
                           schema)
    kinds = [(seg.kind, seg.module) for seg in swapped.segments]
    assert kinds.index(("cached", "tokyo")) < kinds.index(("text", None)) < kinds.index(("cached", "intro"))


@pytest.mark.parametrize("prompt, where", [
    ('<prompt schema="guide" placement="tight"><intro/></prompt>', (1, 1)),
    ('<prompt schema="guide"\n  placement="">\n<intro/></prompt>', (1, 1)),
])
def test_bad_placement_is_a_located_error(tokenizer, prompt, where):
    schema = parse_schema(SCHEMA, tokenizer)
    with pytest.raises(PMLError, match="is not a placement; expected 'schema'") as info:
        parse_prompt(prompt, schema)
    assert (info.value.line, info.value.column) == where
    with pytest.raises(PMLError, match="is not a placement") as info:
        parse_schema('<schema name="x"\n placement="Compact"><module name="a">A.</module></schema>', tokenizer)
    assert (info.value.line, info.value.column) == (1, 1)


def test_geometry_and_packed_positions(tokenizer):
    schema = parse_schema(SCHEMA, tokenizer)
    root_len = len(schema.modules[""].token_ids)
    got = parse_prompt(compact(PROMPTS["other-member"]), schema)
    assert got.geometry_of("tokyo") == "packed", "tokyo sits right after the system prompt, not after intro"
    assert got.own_positions("tokyo") == encoded_positions(schema, "tokyo", "packed")
    assert got.own_positions("tokyo")[0] == root_len
    assert packed_shift(schema, "tokyo") == root_len - schema.modules["tokyo"].start
    assert packed_shift(schema, "") == 0
    first = parse_prompt(compact(PROMPTS["all-of-union-one"]), schema)
    assert set(first.geometry.values()) == {"schema"}
    at_schema = parse_prompt(PROMPTS["all-of-union-one"], schema)
    assert [s for s in first.segments if s.kind == "cached"] == [s for s in at_schema.segments if s.kind == "cached"]
    assert first.position_ids[-1] < at_schema.position_ids[-1], "the question follows the last import at once"


def test_stale_tokens_under_compact_placement(cache):
    resolved = cache.resolve(compact(PROMPTS["other-member"]))
    assert not {m for m, _ in stale_tokens(resolved)} & {"", "tokyo"}, "the first unit after the system prompt is exact"
    shuffled = cache.resolve(compact(SHUFFLED["everything"]))
    intro = cache.schemas["guide"].modules["intro"]
    assert {i for m, i in stale_tokens(shuffled) if m == "intro"} == set(range(len(intro.token_ids)))
    assert not moved(cache, compact(PROMPTS["other-member"]))
    assert {m for m, _ in moved(cache, compact(SHUFFLED["everything"]))} == {"plan", "plan/budget", "plan/food",
                                                                             "tokyo", "intro"}
    assert not moved(cache, SHUFFLED["everything"]), "schema placement moves nothing"


# ----------------------------------------------------------------------------- engine oracle


@pytest.mark.parametrize("name", EXACT)
def test_compact_cached_matches_reference_where_nothing_moved(cache, name):
    prompt = compact(ALL_PROMPTS[name])
    assert not moved(cache, prompt)
    ref = cache.generate(prompt, mode="reference", max_new_tokens=NEW_TOKENS, recompute=0)
    got = cache.generate(prompt, mode="cached", max_new_tokens=NEW_TOKENS, recompute=0)
    assert got.positions == ref.positions and got.prompt_token_ids == ref.prompt_token_ids
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids


@pytest.mark.parametrize("name", sorted(ALL_PROMPTS))
def test_full_recompute_is_full_causal_attention_at_compact_positions(cache, name):
    prompt = compact(ALL_PROMPTS[name])
    got = cache.generate(prompt, max_new_tokens=NEW_TOKENS, recompute=1.0)
    ref = cache.generate(prompt, mode="reference", max_new_tokens=NEW_TOKENS, recompute=1.0)
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids
    resolved = cache.resolve(prompt)
    with torch.inference_mode():
        full = cache.adapter.forward(torch.tensor([resolved.token_ids]), torch.tensor([resolved.position_ids]), None,
                                     DynamicCache(config=cache.model.config))[-1].float()
    assert (got.first_logits - full).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("name", ["nested-some", "shuffled-everything", "shuffled-scaffold-then-union"])
def test_moved_context_is_an_approximation_that_recompute_removes(cache, name):
    """Where anonymous text sits at another distance, cached and reference differ (the states were
    encoded against the old distance) and recomputing the stale tokens closes the gap."""
    prompt = compact(ALL_PROMPTS[name])
    assert moved(cache, prompt)
    ref = cache.generate(prompt, mode="reference", max_new_tokens=1, recompute=1.0)
    plain = cache.generate(prompt, max_new_tokens=1, recompute=0)
    full = cache.generate(prompt, max_new_tokens=1, recompute=1.0)
    assert (plain.first_logits - ref.first_logits).abs().max().item() > 10 * FP32_TOL
    assert (full.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("policy, amount", [("first", 0.5), ("deviation", 0.25), ("epic", 2), ("epic", 100)])
@pytest.mark.parametrize("name", ["other-member", "nested", "scaffold-all", "shuffled-scaffold-all"])
def test_partial_recompute_matches_reference_where_nothing_moved(cache, name, policy, amount):
    prompt = compact(ALL_PROMPTS[name])
    ref = cache.generate(prompt, mode="reference", max_new_tokens=NEW_TOKENS, recompute=amount,
                         recompute_policy=policy)
    got = cache.generate(prompt, max_new_tokens=NEW_TOKENS, recompute=amount, recompute_policy=policy)
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids


def test_epic_policy_picks_k_per_module(cache):
    for prompt in (PROMPTS["everything"], compact(SHUFFLED["everything"])):
        resolved = cache.resolve(prompt)
        stale = stale_tokens(resolved)
        for k in (1, 3):
            chosen = select_recompute(resolved, k, "epic")
            for module in {m for m, _ in stale}:
                own = [i for m, i in stale if m == module]
                assert sorted(i for m, i in chosen if m == module) == own[:k]
        assert select_recompute(resolved, 10 ** 6, "epic") == frozenset(stale)
        assert select_recompute(resolved, 0, "epic") == frozenset()
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="count of tokens per module"):
            select_recompute(resolved, bad, "epic")


def test_compact_in_schema_layout_is_schema_placement_bitwise(cache):
    """A compact prompt whose layout equals its schema layout reads the same blocks, unmoved."""
    for name in ("everything", "all-of-union-one", "scaffold-all"):
        compact_prompt = cache.resolve(compact(PROMPTS[name]))
        if compact_prompt.position_ids != cache.resolve(PROMPTS[name]).position_ids:
            continue
        cache.evict_resident()
        a = cache.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS, recompute=0)
        cache.evict_resident()
        b = cache.generate(compact(PROMPTS[name]), max_new_tokens=NEW_TOKENS, recompute=0)
        assert torch.equal(a.first_logits, b.first_logits) and a.token_ids == b.token_ids


def test_poisoned_rows_never_reach_compact_output(cache):
    arena = cache.scheduler.arena
    prompt = compact(SHUFFLED["everything"])
    arena.drop_idle()
    clean = cache.generate(prompt, max_new_tokens=NEW_TOKENS, recompute=2, recompute_policy="epic")
    arena.drop_idle()
    arena.poison_()
    got = cache.generate(prompt, max_new_tokens=NEW_TOKENS, recompute=2, recompute_policy="epic")
    assert torch.equal(got.first_logits, clean.first_logits) and got.token_ids == clean.token_ids


def test_moved_blocks_are_kept_apart_from_unmoved_ones(cache):
    """The same module placed at its schema positions and moved elsewhere are two arena blocks;
    requests in one batch get what they get alone."""
    prompts = [PROMPTS["other-member"], compact(PROMPTS["other-member"]), compact(SHUFFLED["everything"]),
               SHUFFLED["everything"]]
    alone = [cache.generate(p, max_new_tokens=NEW_TOKENS, recompute=0) for p in prompts]
    with cache.model_lock:
        handles = [cache.submit(p, max_new_tokens=NEW_TOKENS, recompute=0) for p in prompts]
    for handle, solo in zip(handles, alone):
        got = handle.result()
        assert got.token_ids == solo.token_ids
        assert (got.first_logits - solo.first_logits).abs().max().item() <= 1e-4


def test_concurrent_compact_and_schema_requests(cache):
    prompts = [compact(p) for p in ALL_PROMPTS.values()] + list(PROMPTS.values())
    alone = {p: cache.generate(p, max_new_tokens=3, recompute=0).token_ids for p in prompts}
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(len(prompts)):
                p = prompts[(i + offset) % len(prompts)]
                assert cache.generate(p, max_new_tokens=3, recompute=0).token_ids == alone[p]
        except BaseException as exc:  # noqa: BLE001 (collected and reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k * 5,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_bf16_compact_matches_reference(tokenizer):
    pc = PromptCache(tiny_llama(len(tokenizer), seed=1, dtype=torch.bfloat16), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    for name in ("other-member", "scaffold-all"):
        ref = pc.generate(compact(PROMPTS[name]), mode="reference", max_new_tokens=1, recompute=0)
        got = pc.generate(compact(PROMPTS[name]), max_new_tokens=1, recompute=0)
        assert (got.first_logits - ref.first_logits).abs().max().item() <= 0.1
    full = pc.generate(compact(SHUFFLED["everything"]), max_new_tokens=1, recompute=1.0)
    ref = pc.generate(compact(SHUFFLED["everything"]), mode="reference", max_new_tokens=1, recompute=1.0)
    assert (full.first_logits - ref.first_logits).abs().max().item() <= 0.1


# ----------------------------------------------------------------------------- sharing across schemas

SHARED = """<schema name="{name}" placement="compact"><system>Answer from the documents.</system>
{docs}</schema>"""
DOCS = {f"d{i}": f"Document {i}: the {w} bridge was painted {c} in {1900 + 7 * i}." for i, (w, c) in
        enumerate(zip(["north", "south", "east", "west", "old"], ["red", "blue", "green", "grey", "white"]))}


def shared_schema(name: str, docs: list[str]) -> str:
    return SHARED.format(name=name, docs="".join(f'<module name="{d}">{DOCS[d]}</module>' for d in docs))


def test_modules_shared_across_schemas_are_stored_once(tokenizer):
    pc = PromptCache(tiny_llama(len(tokenizer), seed=2), tokenizer, placement="schema")
    a = pc.add_schema(shared_schema("a", ["d0", "d1", "d2"]))
    after_a = len(pc.store)
    b = pc.add_schema(shared_schema("b", ["d3", "d2", "d0"]))
    assert len(pc.store) == after_a + 1, "b adds only d3 (the system prompt is the same root)"
    assert a.modules["d2"].start != b.modules["d2"].start
    assert pc.block_key(a, "d2", "", "packed") == pc.block_key(b, "d2", "", "packed")
    assert pc.block_key(a, "d2") != pc.block_key(b, "d2")
    for prompt in ('<prompt schema="a"><d2/><user>When?</user><assistant/></prompt>',
                   '<prompt schema="b"><d2/><user>When?</user><assistant/></prompt>'):
        got = pc.generate(prompt, max_new_tokens=NEW_TOKENS, recompute=0)
        ref = pc.generate(prompt, mode="reference", max_new_tokens=NEW_TOKENS, recompute=0)
        assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert len(pc.store) == after_a + 1, "reading them encoded nothing more"


def test_another_system_prompt_shares_nothing(tokenizer):
    pc = PromptCache(tiny_llama(len(tokenizer), seed=2), tokenizer, placement="schema")
    a = pc.add_schema(shared_schema("a", ["d0", "d1"]))
    b = pc.add_schema(shared_schema("b", ["d0", "d1"]).replace("Answer from", "Answer using"))
    assert pc.block_key(a, "d0", "", "packed") != pc.block_key(b, "d0", "", "packed")


# ----------------------------------------------------------------------------- families


def test_absolute_positions_refuse_compact_placement(tokenizer):
    from family_models import BY_NAME

    pc = PromptCache(BY_NAME["gpt2"].build(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    for mode in ("cached", "reference"):
        with pytest.raises(PMLError, match="cannot move cached modules to other positions: model type 'gpt2'.*"
                                           "absolute position embeddings") as info:
            pc.generate("\n" + compact(PROMPTS["other-member"]), mode=mode, max_new_tokens=1, recompute=0)
        assert (info.value.line, info.value.column) == (2, 1)
    assert pc.generate(compact(PROMPTS["other-member"]), mode="baseline", max_new_tokens=1).token_ids
    blocks = len(pc.store)
    with pytest.raises(PMLError, match="schema 'c' asks for placement=\"compact\"") as info:
        pc.add_schema('\n\n<schema name="c" placement="compact"><module name="a">A.</module></schema>')
    assert (info.value.line, info.value.column) == (3, 1)
    assert len(pc.store) == blocks and "c" not in pc.schemas


BARE = """<schema name="bare"><module name="a">The first note says the gate opens at nine.</module>
<module name="b">The second note says the gate closes at five, and the keeper is called Odo.</module>
<module name="c">The third note is about <param name="what" len="6"/> near the river.</module></schema>"""
"""No anonymous text before the modules (and no BOS with this tokenizer): a module's context is
itself, so moving it anywhere is exact up to rounding — the re-rotation path, checked exactly."""
BARE_PROMPTS = [
    '<prompt schema="bare" placement="compact"><b/><user>Who keeps the gate?</user><assistant/></prompt>',
    '<prompt schema="bare" placement="compact"><c what="two herons"/><a/><b/><user>When?</user><assistant/></prompt>',
]


def relative_families():
    from family_models import FAMILIES

    return [f for f in FAMILIES if f.relative and f.name != "cohere"]


@pytest.mark.parametrize("family", relative_families(), ids=lambda f: f.name)
def test_moving_blocks_is_exact_in_every_relative_family(tokenizer, family):
    pc = PromptCache(family.build(len(tokenizer)), tokenizer, placement="schema")
    schema = pc.add_schema(BARE)
    assert not schema.modules[""].token_ids
    for prompt in BARE_PROMPTS:
        plan = pc.request(prompt).plan
        assert any(ref.shifts for ref in plan.blocks), "a block is moved"
        ref = pc.generate(prompt, mode="reference", max_new_tokens=NEW_TOKENS, recompute=0)
        got = pc.generate(prompt, max_new_tokens=NEW_TOKENS, recompute=0)
        assert got.positions == ref.positions
        assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
        assert got.token_ids == ref.token_ids
    assert pc.scheduler.counters["blocks_moved"] >= 2
    assert pc.key_rotation().kind == ("none" if "ALiBi" in family.scheme else "rope")


def test_interleaved_rotary_refuses_compact_placement(tokenizer):
    from family_models import BY_NAME

    pc = PromptCache(BY_NAME["cohere"].build(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(BARE)
    with pytest.raises(PMLError, match="model type 'cohere': the keys of layer 0 move in a way rotate-half RoPE"):
        pc.generate(BARE_PROMPTS[0], max_new_tokens=1, recompute=0)
    assert pc.generate(BARE_PROMPTS[0].replace("compact", "schema"), max_new_tokens=1, recompute=0).token_ids


MID = """<schema name="mid"><system>Use the notes.</system><module name="a">Note A: the lamp is blue.</module>
Between the notes.<module name="b">Note B: the door is red.</module></schema>"""


def test_anonymous_text_that_moves_is_stale_and_recomputed(tokenizer):
    """Importing b alone closes a's gap: the anonymous text between a and b keeps its tokens but
    sits nearer the system prompt than when it was encoded, so it is stale (only for that reason)."""
    pc = PromptCache(tiny_llama(len(tokenizer), seed=4), tokenizer, placement="schema")
    schema = pc.add_schema(MID)
    prompt = '<prompt schema="mid" placement="compact"><b/><user>Which colour?</user><assistant/></prompt>'
    resolved = pc.resolve(prompt)
    root = schema.modules[""]
    between = {i for i, p in enumerate(root.position_ids) if p > schema.modules["a"].start}
    assert between and {i for m, i in stale_tokens(resolved) if m == ""} == between
    assert "b" in {m for m, _ in stale_tokens(resolved)}
    got = pc.generate(prompt, max_new_tokens=NEW_TOKENS, recompute=1.0)
    ref = pc.generate(prompt, mode="reference", max_new_tokens=NEW_TOKENS, recompute=1.0)
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids


def test_moved_block_over_fragmented_arena_rows(tokenizer):
    """A moved block whose arena rows come in pieces: each piece gets its rows' deltas."""
    pc = PromptCache(tiny_llama(len(tokenizer), seed=6), tokenizer, placement="schema")
    pc.add_schema(BARE)
    arena = pc.scheduler.arena
    with pc.model_lock:
        first, held, second = arena.allocate(3), arena.allocate(4), arena.allocate(2)
        arena.release(first)
        arena.release(second)
        arena.poison_()
    prompt = BARE_PROMPTS[1]
    got = pc.generate(prompt, max_new_tokens=NEW_TOKENS, recompute=0)
    moved = [b for b in arena.blocks.values() if isinstance(b.key, tuple)]
    assert any(b.rows[0] < held[0] < b.rows[-1] for b in moved), "a moved block spans the held rows"
    ref = pc.generate(prompt, mode="reference", max_new_tokens=NEW_TOKENS, recompute=0)
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids
    with pc.model_lock:
        arena.release(held)
