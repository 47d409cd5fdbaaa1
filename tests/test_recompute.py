"""Selective recompute: cached mode with recomputed module tokens against the reference forward
with the same tokens given uncached visibility (the oracle), on a tiny random Llama.

Also: which tokens are stale, how the policies pick them, and that recomputing every stale token
gives full causal attention over the prompt at its schema positions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pckernels.engine import PromptCache
from pckernels.engine.plan import plan_reference, plan_request, select_recompute, stale_tokens
from test_engine import FP32_TOL, NEW_TOKENS, PROMPTS, SCHEMA, tiny_llama

SHARES = (0.1, 0.5, 1.0)
ORACLE_PROMPTS = ("all-of-union-one", "nested", "nested-some", "scaffold-all", "everything", "params-short")


@pytest.fixture(scope="module")
def tokenizer():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def cache(tokenizer):
    pc = PromptCache(tiny_llama(len(tokenizer), seed=3), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    return pc


@pytest.mark.parametrize("policy", ["first", "deviation"])
@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("name", ORACLE_PROMPTS)
def test_recomputed_cached_matches_reference(cache, name, share, policy):
    ref = cache.generate(PROMPTS[name], mode="reference", max_new_tokens=NEW_TOKENS, recompute=share,
                         recompute_policy=policy)
    got = cache.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS, recompute=share, recompute_policy=policy)
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids
    assert got.positions == ref.positions


def test_recompute_changes_the_answer_distribution(cache):
    plain = cache.generate(PROMPTS["everything"], max_new_tokens=1)
    fresh = cache.generate(PROMPTS["everything"], max_new_tokens=1, recompute=0.5)
    assert (plain.first_logits - fresh.first_logits).abs().max().item() > 1e-2


def test_zero_share_is_plain_cached_mode(cache):
    plain = cache.generate(PROMPTS["everything"], max_new_tokens=NEW_TOKENS)
    zero = cache.generate(PROMPTS["everything"], max_new_tokens=NEW_TOKENS, recompute=0.0,
                          recompute_policy="deviation")
    assert torch.equal(plain.first_logits, zero.first_logits)
    assert plain.token_ids == zero.token_ids


def test_token_counts(cache):
    resolved = cache.resolve(PROMPTS["everything"])
    chosen = select_recompute(resolved, 0.5, "first")
    plain = cache.generate(resolved, max_new_tokens=1)
    got = cache.generate(resolved, max_new_tokens=1, recompute=0.5)
    assert got.cached_tokens == plain.cached_tokens - len(chosen)
    assert got.computed_tokens == plain.computed_tokens + len(chosen)


@pytest.mark.parametrize("name", ["all-of-union-one", "nested-some", "everything"])
def test_full_recompute_is_full_causal_attention_at_schema_positions(cache, name):
    """Recomputing every stale token leaves only exact cached states: the prompt reads as one
    causal forward over its live tokens at their schema positions."""
    got = cache.generate(PROMPTS[name], max_new_tokens=1, recompute=1.0)
    resolved = cache.resolve(PROMPTS[name])
    ids = torch.tensor([resolved.token_ids])
    positions = torch.tensor([resolved.position_ids])
    with torch.inference_mode():
        full = cache.adapter.forward(ids, positions, None, DynamicCache(config=cache.model.config))[-1].float()
    assert (got.first_logits - full).abs().max().item() <= FP32_TOL


def test_buffer_reuse_after_recompute_stays_exact(cache):
    """Recompute overwrites cached rows in the reused buffer; the next prompt must not read them."""
    for name in ("everything", "nested"):
        cache.generate(PROMPTS[name], max_new_tokens=2, recompute=0.5, recompute_policy="deviation")
        ref = cache.generate(PROMPTS[name], mode="reference", max_new_tokens=NEW_TOKENS)
        got = cache.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS)
        assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
        assert got.token_ids == ref.token_ids


def test_stale_tokens(cache):
    schema = cache.schemas["guide"]
    resolved = cache.resolve(PROMPTS["all-of-union-one"])
    stale = stale_tokens(resolved)
    stale_modules = {module for module, _ in stale}
    assert "intro" not in stale_modules, "the first module after the system prompt is exact"
    assert {i for m, i in stale if m == "paris"} == set(range(len(schema.modules["paris"].token_ids)))
    assert stale == sorted(stale, key=lambda ref: schema.modules[ref[0]].position_ids[ref[1]])
    plan = schema.modules["plan"]
    slots = {p.offset + k for p in plan.params for k in range(p.length)}
    nested = stale_tokens(cache.resolve(PROMPTS["nested"]))
    assert not slots & {i for m, i in nested if m == "plan"}
    assert {"plan/budget", "plan/food"} <= {m for m, _ in nested}


def test_policies_pick_their_tokens(cache):
    resolved = cache.resolve(PROMPTS["everything"])
    stale = stale_tokens(resolved)
    assert select_recompute(resolved, 0.0) == frozenset()
    assert select_recompute(resolved, 1.0) == frozenset(stale)
    assert select_recompute(resolved, 1.0, "deviation", lambda: cache.deviation.for_schema(resolved.schema)) \
        == frozenset(stale)
    first = select_recompute(resolved, 0.25, "first")
    for module in {m for m, _ in stale}:
        own = [i for m, i in stale if m == module]
        picked = sorted(i for m, i in first if m == module)
        assert picked == own[:len(picked)] and picked
    scores = cache.deviation.for_schema(resolved.schema)
    top = select_recompute(resolved, 0.25, "deviation", lambda: scores)
    assert len(top) == -(-len(stale) // 4)
    lowest_picked = min(float(scores[m][i]) for m, i in top)
    assert all(float(scores[m][i]) <= lowest_picked for m, i in set(stale) - top)


def test_deviation_scores_are_zero_where_the_cache_is_exact(cache):
    schema = cache.schemas["guide"]
    scores = cache.deviation.for_schema(schema)
    assert set(scores) == set(schema.modules)
    for name, module in schema.modules.items():
        assert scores[name].shape == (len(module.token_ids),)
    assert scores[""][:3].abs().max().item() < 1e-4, "the start of the system prompt has no context to miss"
    assert scores["intro"].abs().max().item() < 1e-4, "nothing but the system prompt precedes the first module"
    assert scores["paris"].max().item() > 1e-3


def test_reference_plan_duplicates_recomputed_tokens(cache):
    resolved = cache.resolve(PROMPTS["all-of-union-one"])
    chosen = select_recompute(resolved, 0.5)
    ref = plan_reference(resolved, chosen)
    plain = plan_reference(resolved)
    assert len(ref.tokens) == len(plain.tokens) + len(chosen)
    assert sum(ref.live) == sum(plain.live)
    plan = plan_request(resolved, chosen)
    assert plan.new_positions == sorted(plan.new_positions)
    assert len(plan.new_tokens) == len(plan_request(resolved).new_tokens) + len(chosen)
    assert plan.cached_tokens == plan_request(resolved).cached_tokens - len(chosen)
    hidden = {(ref.module, i) for ref in plan.blocks for i in ref.hidden}
    assert set(chosen) <= hidden


@pytest.mark.parametrize("share, policy", [(-0.1, "first"), (1.5, "first"), (0.5, "random")])
def test_bad_recompute_arguments(cache, share, policy):
    with pytest.raises(ValueError):
        cache.generate(PROMPTS["everything"], max_new_tokens=1, recompute=share, recompute_policy=policy)


def test_baseline_refuses_recompute(cache):
    with pytest.raises(ValueError, match="baseline"):
        cache.generate(PROMPTS["everything"], mode="baseline", max_new_tokens=1, recompute=0.5)
