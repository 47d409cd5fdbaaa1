"""What a user gets without choosing: compact placement with the first 8 stale tokens of every
module recomputed (``epic@8``); schema placement (the paper's exact semantics) one argument or
attribute away; models that cannot move cached keys fall back to schema placement, logged.

The oracles: a default-mode answer equals the reference forward at the compact positions with
the same recompute wherever nothing moved against its anonymous text, and the same request with
``placement="compact", recompute=8, recompute_policy="epic"`` spelled out (same tokens, same
first logits, same counts); schema placement keeps ``cached == reference`` everywhere.
"""

from __future__ import annotations

import logging

import pytest
from test_engine import FP32_TOL, PROMPTS, SCHEMA, tiny_llama

from pckernels import PMLError
from pckernels.engine import PromptCache
from pckernels.engine.plan import DEFAULT_RECOMPUTE, default_recompute, select_recompute, stale_tokens
from pckernels.pml import parse_schema

OPEN = '<prompt schema="guide">'


def placed(prompt: str, placement: str) -> str:
    assert prompt.startswith(OPEN)
    return f'<prompt schema="guide" placement="{placement}">' + prompt[len(OPEN):]


@pytest.fixture(scope="module")
def tokenizer():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer), seed=3)


@pytest.fixture(scope="module")
def default(model, tokenizer):
    pc = PromptCache(model, tokenizer)
    pc.add_schema(SCHEMA)
    yield pc
    pc.close()


@pytest.fixture(scope="module")
def exact(model, tokenizer):
    pc = PromptCache(model, tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    yield pc
    pc.close()


def same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert (a.first_logits - b.first_logits).abs().max().item() <= FP32_TOL
    assert (a.cached_tokens, a.computed_tokens) == (b.cached_tokens, b.computed_tokens)


def test_default_recompute_rule():
    assert DEFAULT_RECOMPUTE["compact"] == (8, "epic") and DEFAULT_RECOMPUTE["schema"] == (0.0, "first")
    assert default_recompute("compact", None, None) == (8, "epic")
    assert default_recompute("schema", None, None) == (0.0, "first")
    assert default_recompute("compact", None, "epic") == (8, "epic")
    assert default_recompute("schema", None, "epic") == (8, "epic")
    assert default_recompute("compact", 0, None) == (0, "first")
    assert default_recompute("compact", 0.5, "deviation") == (0.5, "deviation")
    with pytest.raises(ValueError, match="recompute_policy='first' needs recompute="):
        default_recompute("compact", None, "first")


def test_schemas_are_compact_unless_they_say(default, exact, tokenizer):
    assert default.schemas["guide"].placement == "compact"
    assert exact.schemas["guide"].placement == "schema"
    explicit = SCHEMA.replace('<schema name="guide">', '<schema name="explicit" placement="schema">')
    assert default.add_schema(explicit).placement == "schema"
    assert parse_schema(SCHEMA, tokenizer).placement == "schema"
    assert parse_schema(SCHEMA, tokenizer, placement="compact").placement == "compact"
    with pytest.raises(ValueError, match="placement must be one of"):
        parse_schema(SCHEMA, tokenizer, placement="packed")
    with pytest.raises(ValueError, match="placement must be one of"):
        PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="packed")


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_default_is_compact_with_epic_8(default, exact, name):
    """The default request is the spelled-out compact + epic@8 request, on either engine."""
    prompt = PROMPTS[name]
    resolved = default.resolve(prompt)
    assert resolved.placement == "compact"
    got = default.generate(prompt, max_new_tokens=4)
    same(got, default.generate(prompt, max_new_tokens=4, recompute=8, recompute_policy="epic"))
    same(got, exact.generate(placed(prompt, "compact"), max_new_tokens=4, recompute=8, recompute_policy="epic"))
    recomputed = select_recompute(resolved, 8, "epic")
    none = default.generate(prompt, max_new_tokens=4, recompute=0)
    assert got.computed_tokens == none.computed_tokens + len(recomputed)
    assert len(recomputed) == sum(min(8, n) for n in _stale_per_module(resolved).values())


def _stale_per_module(resolved) -> dict[str, int]:
    counts: dict[str, int] = {}
    for module, _ in stale_tokens(resolved):
        counts[module] = counts.get(module, 0) + 1
    return counts


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_schema_placement_is_one_argument_away_and_exact(default, exact, name):
    """``placement="schema"`` (engine or prompt): nothing recomputed, cached == reference."""
    prompt = PROMPTS[name]
    got = exact.generate(prompt, max_new_tokens=4)
    ref = exact.generate(prompt, max_new_tokens=4, mode="reference")
    assert got.token_ids == ref.token_ids
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    same(got, default.generate(placed(prompt, "schema"), max_new_tokens=4))
    assert exact.resolve(prompt).placement == "schema"


def test_default_matches_its_oracle_where_nothing_moved(default):
    """In schema order with nothing left out the compact layout is the schema layout: the default
    answer (epic@8 recomputed) equals the reference forward with the same recompute."""
    prompt = PROMPTS["scaffold-all"]
    got = default.generate(prompt, max_new_tokens=4)
    ref = default.generate(prompt, max_new_tokens=4, mode="reference")
    assert got.token_ids == ref.token_ids
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL


def test_baseline_is_unchanged_by_the_default(default, exact):
    prompt = PROMPTS["everything"]
    a = default.generate(prompt, mode="baseline", max_new_tokens=4)
    b = exact.generate(prompt, mode="baseline", max_new_tokens=4)
    assert a.token_ids == b.token_ids and (a.first_logits - b.first_logits).abs().max().item() <= FP32_TOL
    with pytest.raises(ValueError, match="not baseline"):
        default.generate(prompt, mode="baseline", max_new_tokens=1, recompute=8, recompute_policy="epic")


def test_absolute_positions_fall_back_to_schema_placement(tokenizer, caplog):
    """A model that cannot move cached modules (GPT-2's learned positions): schemas that name no
    placement get schema placement with one logged line; asking for compact is still an error."""
    from family_models import BY_NAME

    pc = PromptCache(BY_NAME["gpt2"].build(len(tokenizer)), tokenizer)
    try:
        with caplog.at_level(logging.WARNING, logger="pckernels.engine.namespaces"):
            schema = pc.add_schema(SCHEMA)
            pc.add_schema(SCHEMA.replace('name="guide"', 'name="again"'))
        assert schema.placement == "schema"
        lines = [r for r in caplog.records if "schemas use schema placement" in r.getMessage()]
        assert len(lines) == 1 and "absolute position embeddings" in lines[0].getMessage()
        got = pc.generate(PROMPTS["everything"], max_new_tokens=3)
        ref = pc.generate(PROMPTS["everything"], max_new_tokens=3, mode="reference")
        assert got.token_ids == ref.token_ids
        with pytest.raises(PMLError, match="cannot move cached modules"):
            pc.generate(placed(PROMPTS["everything"], "compact"), max_new_tokens=1)
        with pytest.raises(PMLError, match="asks for placement=\"compact\""):
            pc.add_schema('<schema name="c" placement="compact"><module name="a">A.</module></schema>')
    finally:
        pc.close()


def test_program_calls_get_the_default(model, tokenizer):
    import program_examples as ex

    pc = PromptCache(model, tokenizer)
    try:
        call = ex.rag(frozenset(ex.DOCS[1:]), "Which document?")
        resolved = pc.resolve(call)
        assert resolved.placement == "compact"
        got = pc.generate(call, max_new_tokens=3)
        assert got.token_ids == pc.generate(call, max_new_tokens=3, recompute=8, recompute_policy="epic").token_ids
    finally:
        pc.close()
