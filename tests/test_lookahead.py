"""Prompt-lookup speculation (``PromptCache(lookahead=k)``): a greedy request's decode step verifies
a draft taken from its own context, and the answer is the one decoding a token per step gives.

The drafter is checked on its own; the engine against an engine without lookahead on the same
weights, in every mode, through the prefix cache, under threads, with drafts that are always
wrong (their rows must stay invisible until overwritten) and with sampling (no drafts).
Verifying several rows per step changes how many rows a matmul has, so — as with batching —
greedy tokens are equal and fp32 first logits agree to ``BATCH_TOL``.
"""

from __future__ import annotations

import random

import pytest

from pckernels.engine import PromptCache
from pckernels.engine.lookahead import NgramDrafter
from test_batching import BATCH_TOL, MODES, NAMES, run_threads
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (fixture)

NEW_TOKENS = 24
LOOKAHEAD = 4


def test_drafter_proposes_what_followed_the_latest_longest_match():
    drafter = NgramDrafter([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert drafter.propose(3) == []  # (7, 8) and (8,) never occurred before the end
    drafter.extend([1, 2, 3])
    assert drafter.propose(3) == [4, 5, 9]  # (1, 2, 3) at 0 beats (2, 3) at 6
    assert drafter.propose(1) == [4]
    drafter.extend([7])
    assert drafter.propose(5) == [8, 1, 2, 3, 7]  # (2, 3, 7) latest at 6
    drafter.extend([8, 1, 2, 3, 7, 8])
    assert drafter.propose(4) == [1, 2, 3, 7]  # the latest (3, 7, 8) is the second one


def test_drafter_edges():
    assert NgramDrafter([]).propose(4) == []
    assert NgramDrafter([5, 5]).propose(4) == []
    assert NgramDrafter([5, 5, 5]).propose(4) == [5]  # (5, 5) at 0, one token after it
    assert NgramDrafter([1, 2, 1, 2]).propose(0) == []
    assert NgramDrafter([1, 2, 9, 1, 2]).propose(8) == [9, 1, 2]  # cut at the end of the context


@pytest.fixture(scope="module")
def engines(tokenizer):  # noqa: F811
    out = []
    for lookahead in (0, LOOKAHEAD):
        pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, lookahead=lookahead, placement="schema")
        pc.add_schema(SCHEMA)
        out.append(pc)
    return out


def assert_same_answer(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert (got.first_logits - want.first_logits).abs().max().item() <= BATCH_TOL
    assert got.finish_reason == want.finish_reason


def test_lookahead_answers_are_those_of_one_token_per_step(engines):
    plain, ahead = engines
    ahead.scheduler.counters.clear()
    for name in NAMES:
        for mode in MODES:
            want = plain.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS, mode=mode)
            got = ahead.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS, mode=mode)
            assert_same_answer(got, want)
            assert len(got.token_ids) <= NEW_TOKENS
    counters = ahead.scheduler.counters
    assert counters["draft_tokens"] > 0 and counters["draft_accepted"] > 0
    steps = counters["steps"]
    assert steps < sum(len(plain.generate(PROMPTS[n], max_new_tokens=NEW_TOKENS, mode=m).token_ids)
                       for n in NAMES for m in MODES), "accepted drafts must save steps"
    assert ahead.scheduler.arena.referenced_rows() == 0


def test_lookahead_through_the_prefix_cache_and_with_stops(engines):
    plain, ahead = engines
    text = "one two three four five six seven eight nine ten " * 6
    for options in ({}, {"stop": ["seven"]}, {"max_new_tokens": 3}):
        options = {"max_new_tokens": NEW_TOKENS, **options}
        want = plain.complete(text, **options)
        got = ahead.complete(text, **options)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason


def test_rejected_drafts_never_reach_an_answer(engines, monkeypatch):
    """Every draft wrong: its rows hold KV of tokens that were never chosen, visible to the request
    but at positions after every query until the chosen tokens overwrite them."""
    plain, ahead = engines
    rng = random.Random(0)
    vocab = len(ahead.tokenizer)
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, k: [rng.randrange(vocab) for _ in range(k)])
    ahead.scheduler.counters.clear()
    for name in ("everything", "nested", "none"):
        want = plain.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS)
        got = ahead.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS)
        assert_same_answer(got, want)
    counters = ahead.scheduler.counters
    assert counters["draft_tokens"] > counters["draft_accepted"]


def test_sampling_drafts_nothing(engines):
    plain, ahead = engines
    ahead.scheduler.counters.clear()
    want = plain.generate(PROMPTS["everything"], max_new_tokens=NEW_TOKENS, temperature=0.8, seed=3)
    got = ahead.generate(PROMPTS["everything"], max_new_tokens=NEW_TOKENS, temperature=0.8, seed=3)
    assert got.token_ids == want.token_ids
    assert ahead.scheduler.counters["draft_tokens"] == 0


def test_lookahead_under_threads_equals_serial(engines):
    plain, ahead = engines
    names = ["everything", "nested", "all-of-union-one", "scaffold-all", "text-only"]
    want = {name: plain.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS) for name in names}
    got = {}

    def work(i):
        for name in names[i:] + names[:i]:
            got[i, name] = ahead.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS)

    run_threads(4, work)
    for (_, name), result in got.items():
        assert result.token_ids == want[name].token_ids
    assert ahead.scheduler.arena.referenced_rows() == 0


def test_negative_lookahead_is_refused(tokenizer):  # noqa: F811
    with pytest.raises(ValueError, match="lookahead"):
        PromptCache(tiny_llama(len(tokenizer)), tokenizer, lookahead=-1, placement="schema")
