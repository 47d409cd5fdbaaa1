"""Planning reads what is derived from a module's tokens once per module (issue 41): every planned
request must equal what the straightforward per-token code gave (``plan_oracle``, a frozen copy of
it) — segments, compact layout, token ids, positions, stale and moved tokens, recompute selection,
the last cached token, block refs and new tokens, the reference mask — on the guide schema of
``test_engine`` and on a schema of odd shapes (size-1 modules, a parameter at a module's start and
at its end, an empty union member, an empty module just before anonymous text, nested modules with a scaffold inside, an uncached module, a
top-level scaffold), with prompts drawn at random, at compact and at schema placement.

The per-module data lives on the schema's ``Module`` objects: a schema added again with other text
brings new modules (and new plans), and a removed schema takes its data with it.
"""

from __future__ import annotations

import gc
import random
import weakref

import plan_oracle as oracle
import pytest
import torch
from test_engine import PROMPTS, SCHEMA, SHUFFLED, tiny_llama

from pckernels import PMLError
from pckernels.engine import PromptCache
from pckernels.engine.plan import (RequestPlan, _moved_tokens, default_recompute, last_cached_token, plan_reference,
                                   plan_request, scaffold_variants, select_recompute, stale_runs, stale_tokens)
from pckernels.pml import parse_prompt, parse_schema
from pckernels.pml import prompt as prompt_module
from pckernels.pml import prompt_text

ODD = """
<schema name="odd">
  <system>Be brief.</system>
  <module name="one">A</module>
  <module name="buf"><param name="q" len="3"/> then go on.</module>
  <module name="tail">End with <param name="z" len="1"/></module>
  <union name="pick">
    <module name="none"></module>
    <module name="seven">Seven tokens live in this module here.</module>
    <module name="x">x</module>
  </union>
  <module name="blank"></module>
  Some anonymous text between.
  <module name="outer">Outer starts <module name="in1">inner one</module> middle <module name="in2">B</module> ends.
    <scaffold name="inner-pair"><module name="s1">S one.</module><module name="s2">S</module></scaffold>
  </module>
  <module name="live" cache="false">Now <param name="d" len="2"/>.</module>
  <scaffold name="duo"><module name="d1">Duo one here.</module><module name="d2">Z</module></scaffold>
  <user>Question follows.</user>
</schema>
"""

GROUPS = [
    ["<one/>"],
    ["<blank/>"],
    ["<buf/>", '<buf q="hi"/>', '<buf q="ok go"/>'],
    ["<tail/>", '<tail z="k"/>'],
    ["<none/>", "<seven/>", "<x/>"],
    ["<outer/>", "<outer><in1/></outer>", "<outer><in2/><inner-pair/></outer>", "<outer><s2/><in1/></outer>",
     "<module name=\"outer/in2\"/>"],
    ['<live d="hi"/>', "<live/>"],
    ["<duo/>", "<d1/>", "<d2/>", "<d2/><d1/>"],
]
TEXTS = ["Note.", " and then some more words here", "7"]


def random_prompts(count: int, seed: int = 3) -> list[str]:
    """Prompts over ``ODD``: random groups in random order, text between imports now and then, and
    trailing text or none (a prompt that ends with an import)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        picked = [rng.choice(group) for group in rng.sample(GROUPS, rng.randint(1, len(GROUPS)))]
        body = "".join(item + (rng.choice(TEXTS) if rng.random() < 0.25 else "") for item in picked)
        tail = rng.choice(["<user>Why?</user><assistant/>", " Go on.", ""])
        out.append(f'<prompt schema="odd">{body}{tail}</prompt>')
    return out


def placed(prompt: str, placement: str) -> str:
    head, rest = prompt.split(">", 1)
    return f'{head} placement="{placement}">{rest}'


CASES = ([("guide", p) for p in (*PROMPTS.values(), *SHUFFLED.values())]
         + [("odd", p) for p in random_prompts(60)]
         + [("odd", '<prompt schema="odd"><one/></prompt>'),
            ("odd", '<prompt schema="odd"><x/><one/></prompt>'),
            ("odd", '<prompt schema="odd"><tail z="k"/></prompt>'),
            ("odd", '<prompt schema="odd"><one/><blank/> After the empty module.<seven/></prompt>'),
            ("odd", '<prompt schema="odd"><none/>Only text after an empty module.</prompt>')])


@pytest.fixture(scope="module")
def tokenizer():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def schemas(tokenizer):
    return {"guide": parse_schema(SCHEMA, tokenizer), "odd": parse_schema(ODD, tokenizer)}


def checked_resolve(monkeypatch, text: str, schema) -> tuple:
    """``parse_prompt`` with its compact layout and module segments checked against the oracle's."""
    layouts = []
    real_layout, real_segments = prompt_text.compact_layout, prompt_module._module_segments

    def layout(*args):
        got, want = real_layout(*args), oracle.compact_layout(*args)
        layouts.append((got, want))
        return got

    def segments(module, arguments):
        got = real_segments(module, arguments)
        assert got == oracle._module_segments(module, arguments), module.name
        return got

    monkeypatch.setattr(prompt_text, "compact_layout", layout)
    monkeypatch.setattr(prompt_module, "_module_segments", segments)
    try:
        resolved = parse_prompt(text, schema)
    finally:
        monkeypatch.undo()
    for got, want in layouts:
        assert got.segments == want.segments
        assert got.geometry == want.geometry and got.end == want.end
    return resolved, (layouts[0][1] if layouts else None)


def deviation_scores(prompt):
    """Deterministic per-token scores with ties (the deviation policy breaks them by position)."""
    return lambda: {name: [float((7 * i + len(name)) % 5) for i in range(len(m.token_ids))]
                    for name, m in prompt.schema.modules.items()}


SELECTIONS = [(0.0, "first"), (0.35, "first"), (1.0, "first"), (1, "epic"), (8, "epic"), (0.5, "deviation")]


def assert_plans_equal(got: RequestPlan, want: RequestPlan) -> None:
    assert got.blocks == want.blocks
    assert got.new_tokens == want.new_tokens and got.new_positions == want.new_positions
    assert got.cached_tokens == want.cached_tokens and got.live == want.live
    assert (got.prefill_mask is None) == (want.prefill_mask is None)
    if got.prefill_mask is not None:
        assert torch.equal(got.prefill_mask, want.prefill_mask)


@pytest.mark.parametrize("placement", ["compact", "schema"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_plan_equals_the_per_token_oracle(monkeypatch, schemas, placement, index):
    name, text = CASES[index]
    try:
        resolved, layout = checked_resolve(monkeypatch, placed(text, placement), schemas[name])
    except PMLError:
        assert placement == "schema", "compact placement needs no room for text"
        pytest.skip("text without room at schema placement (refused the same way before)")
    live = [s for s in resolved.segments if s.kind != "slot"]
    assert resolved.token_ids == tuple(t for s in live for t in s.token_ids)
    assert resolved.position_ids == tuple(p for s in live for p in s.position_ids)
    assert resolved.last_position == max(resolved.position_ids)
    for module in resolved.modules:
        positions = resolved.own_positions(module)
        if layout is not None:
            assert positions == layout.positions[module]
        for i, position in enumerate(positions):
            assert resolved.own_index(module, position) == i
    assert stale_tokens(resolved) == oracle.stale_tokens(resolved)
    assert [t for m, a, b in stale_runs(resolved) for t in [(m, i) for i in range(a, b)]] == stale_tokens(resolved)
    variants = scaffold_variants(resolved)
    assert _moved_tokens(resolved, variants) == oracle._moved_tokens(resolved, variants)
    last = last_cached_token(resolved)
    assert last == oracle.last_cached_token(resolved)
    for share, policy in SELECTIONS:
        scores = deviation_scores(resolved)
        chosen = select_recompute(resolved, share, policy, scores)
        assert chosen == oracle.select_recompute(resolved, share, policy, scores), (share, policy)
        recompute = chosen | ({last} if last else set())
        ref, want_ref = plan_reference(resolved, recompute), oracle.plan_reference(resolved, recompute)
        assert (ref.tokens, ref.positions, ref.live) == (want_ref.tokens, want_ref.positions, want_ref.live)
        assert torch.equal(ref.mask, want_ref.mask)
        try:
            want = oracle.plan_request(resolved, recompute)
        except ValueError:
            with pytest.raises(ValueError, match="at least one token"):
                plan_request(resolved, recompute)
            continue
        assert_plans_equal(plan_request(resolved, recompute), want)


def test_modules_keep_their_derived_data(schemas):
    """A module's segments are made once: two prompts importing it share them (no per-request copy of
    its tokens at schema placement)."""
    schema = schemas["odd"]
    first = parse_prompt('<prompt schema="odd" placement="schema"><seven/><user>Hi.</user></prompt>', schema)
    second = parse_prompt('<prompt schema="odd" placement="schema"><seven/><one/></prompt>', schema)
    seven = schema.modules["seven"]
    assert "pieces" in vars(seven)
    mine = [s for s in first.segments if s.module == "seven"]
    assert mine and all(any(s is piece for piece in seven.pieces) for s in mine)
    assert [s for s in second.segments if s.module == "seven"][0] is mine[0]
    compact = parse_prompt('<prompt schema="odd" placement="compact"><seven/><one/></prompt>', schema)
    moved = [s for s in compact.segments if s.module == "seven"][0]
    assert moved.position_ids[0] < seven.position_ids[0], "seven fills the place of one"
    assert moved.position_ids == tuple(range(moved.position_ids[0], moved.position_ids[0] + len(seven.token_ids)))


# ----------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def cache(tokenizer):
    pc = PromptCache(tiny_llama(len(tokenizer), seed=5), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    pc.add_schema(ODD)
    return pc


def oracle_request(resolved, mode: str, recompute, policy) -> tuple[list, list, RequestPlan]:
    """``RequestBuilder.pml``'s prompt and plan, from the oracle's functions."""
    share, policy = default_recompute(resolved.placement, recompute, policy)
    chosen = oracle.select_recompute(resolved, share, policy)
    last = oracle.last_cached_token(resolved)
    if last is not None:
        chosen = chosen | {last}
    live = [s for s in resolved.segments if s.kind != "slot"]
    tokens, positions = [t for s in live for t in s.token_ids], [p for s in live for p in s.position_ids]
    if mode == "reference":
        ref = oracle.plan_reference(resolved, chosen)
        return tokens, positions, RequestPlan([], ref.tokens, ref.positions, 0, live=ref.live, prefill_mask=ref.mask)
    return tokens, positions, oracle.plan_request(resolved, chosen)


@pytest.mark.parametrize("mode", ["cached", "reference"])
@pytest.mark.parametrize("recompute, policy", [(None, None), (0, None), (0.5, "first"), (2, "epic")])
def test_requests_equal_the_oracle(cache, mode, recompute, policy):
    cases = CASES[::5]
    for name, text in cases:
        for placement in ("compact", "schema"):
            prompt = placed(text, placement)
            try:
                request = cache.request(prompt, mode=mode, recompute=recompute, recompute_policy=policy)
            except PMLError:
                assert placement == "schema"
                continue
            resolved = cache.resolve(prompt)
            tokens, positions, plan = oracle_request(resolved, mode, recompute, policy)
            assert request.prompt_token_ids == tokens and request.positions == positions
            assert_plans_equal(request.plan, plan)


def test_a_schema_added_again_or_removed_takes_its_module_data_along(cache, tokenizer):
    prompt = '<prompt schema="swap"><doc/><user>Go.</user><assistant/></prompt>'
    cache.add_schema('<schema name="swap"><system>S.</system><module name="doc">First text of the doc.</module>'
                     '</schema>')
    before = cache.request(prompt)
    old = cache.schemas["swap"]
    old_doc = old.modules["doc"]
    assert "pieces" in vars(old_doc)
    cache.add_schema('<schema name="swap"><system>S.</system><module name="doc">A second and longer text of the '
                     'doc, with more tokens.</module></schema>')
    new = cache.schemas["swap"]
    assert new is not old and new.modules["doc"] is not old_doc
    after = cache.request(prompt)
    assert after.prompt_token_ids != before.prompt_token_ids
    resolved = cache.resolve(prompt)
    tokens, positions, plan = oracle_request(resolved, "cached", None, None)
    assert after.prompt_token_ids == tokens and after.positions == positions
    assert_plans_equal(after.plan, plan)
    assert after.plan.blocks[1].n_rows == len(new.modules["doc"].token_ids) != before.plan.blocks[1].n_rows
    assert all(s.module != "doc" or any(s is p for p in new.modules["doc"].pieces)
               for s in parse_prompt(prompt.replace('swap">', 'swap" placement="schema">'), new).segments)

    gone = weakref.ref(new)
    del before, after, resolved, plan, new, old, old_doc
    assert cache.remove_schema("swap")
    with pytest.raises(PMLError, match="unknown schema"):
        cache.request(prompt)
    cache.scheduler.call(lambda: None)  # the model thread holds its last call (the encode's closure) until the next
    gc.collect()
    assert gone() is None, "nothing keeps a removed schema (or its modules' data) alive"
