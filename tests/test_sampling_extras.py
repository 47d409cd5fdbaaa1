"""vLLM's sampling extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``) on
:class:`TokenChoice`, each against a plain-torch reference of vLLM's definition on fixed logits
of odd vocabulary sizes; then in the engine: batched answers equal lone ones, and drafts with a
repetition penalty (greedy) give the answer of no drafts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pckernels.errors import OptionError
from pckernels.generation import SamplingParams, TokenChoice
from pckernels.generation.sampling import filter_logits

EOS = 2
SPECIAL = {EOS: "</s>", 0: "<pad>"}


class Letters:
    """A tokenizer stand-in: id i is one letter (ids 0 and 2 are special)."""

    def decode(self, ids, skip_special_tokens=True):
        out = []
        for i in ids:
            if i in SPECIAL:
                if not skip_special_tokens:
                    out.append(SPECIAL[i])
                continue
            out.append(chr(97 + i % 26))
        return "".join(out)


def logits_of(vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=gen) * 3


def ref_repetition(logits: torch.Tensor, seen: set[int], penalty: float) -> torch.Tensor:
    """vLLM: a token of the prompt or output has logit / penalty when positive, * penalty otherwise."""
    out = logits.clone()
    for t in seen:
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def ref_filter(scaled: torch.Tensor, top_k: int, min_p: float) -> torch.Tensor:
    """vLLM: min_p against the likeliest token's probability, then the k best logits (ties kept)."""
    out = scaled.clone()
    if min_p > 0:
        probs = torch.softmax(scaled, -1)
        for i in range(len(out)):
            if probs[i] < min_p * probs.max():
                out[i] = float("-inf")
    if 0 < top_k < len(out):
        kth = sorted(out.tolist(), reverse=True)[top_k - 1]
        out[out < kth] = float("-inf")
    return out


@pytest.mark.parametrize("field, value", [
    ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.5), ("repetition_penalty", 0.0),
    ("repetition_penalty", float("nan")), ("min_tokens", -1), ("min_tokens", 65), ("ignore_eos", "yes"),
    ("stop_token_ids", [-1]), ("stop_token_ids", "ab"), ("skip_special_tokens", 1),
    ("include_stop_str_in_output", None)])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(OptionError) as info:
        SamplingParams(max_new_tokens=64, **{field: value})
    assert info.value.option == field and field in str(info.value)


def test_off_values_are_accepted_as_vllm_has_them():
    for k in (-1, 0):
        assert SamplingParams(top_k=k).top_k == k
    params = SamplingParams(max_new_tokens=5, min_tokens=5, stop_token_ids=[7, 3])
    assert params.stop_token_ids == (7, 3) and not SamplingParams().adjusts


@pytest.mark.parametrize("vocab", [1, 7, 37, 101])
def test_repetition_penalty_against_the_reference(vocab):
    prompt = [t % vocab for t in (3, 5, 5, 30, 6)]
    params = SamplingParams(repetition_penalty=1.7)
    choice = TokenChoice(params, None, {EOS}, prompt_token_ids=prompt)
    raw = logits_of(vocab)
    assert torch.equal(choice._adjust(raw), ref_repetition(raw, set(prompt), 1.7))
    token = choice.choose(raw, 10)
    assert token == int(torch.argmax(ref_repetition(raw, set(prompt), 1.7)))
    raw2 = logits_of(vocab, 1)
    assert torch.equal(choice._adjust(raw2), ref_repetition(raw2, set(prompt) | {token}, 1.7))
    less = TokenChoice(SamplingParams(repetition_penalty=0.5), None, {EOS}, prompt_token_ids=prompt)
    assert torch.equal(less._adjust(raw), ref_repetition(raw, set(prompt), 0.5))


def test_repetition_penalty_changes_the_greedy_choice():
    raw = torch.tensor([0.0, 1.0, 0.5, 4.0, 3.0, -1.0, 0.2])
    assert TokenChoice(SamplingParams(), None, set()).choose(raw, 0) == 3
    choice = TokenChoice(SamplingParams(repetition_penalty=2.0), None, set(), prompt_token_ids=[3])
    assert choice.choose(raw, 0) == 4  # 4 / 2 < 3
    assert choice.choose(raw, 1) == 3  # 3 seen now too: 2.0 vs 1.5


@pytest.mark.parametrize("vocab", [5, 37, 101])
@pytest.mark.parametrize("top_k, min_p", [(1, 0.0), (3, 0.0), (0, 0.2), (4, 0.05), (-1, 0.3), (500, 0.0)])
def test_top_k_and_min_p_against_the_reference(vocab, top_k, min_p):
    scaled = logits_of(vocab, 2) / 0.7
    assert torch.equal(filter_logits(scaled, top_k=top_k, min_p=min_p), ref_filter(scaled, top_k, min_p))
    # the sampled token is drawn from the reference's distribution with the request's seed
    params = SamplingParams(temperature=0.7, top_k=top_k, min_p=min_p, seed=11)
    choice = TokenChoice(params, None, set())
    draws = [choice.choose(logits_of(vocab, 2), i) for i in range(20)]
    gen = torch.Generator().manual_seed(11)
    probs = torch.softmax(ref_filter(scaled, top_k, min_p), -1)
    assert draws == [int(torch.multinomial(probs, 1, generator=gen)) for _ in range(20)]
    kept = set(torch.nonzero(probs > 0).flatten().tolist())
    assert set(draws) <= kept


def test_min_tokens_masks_eos_and_stop_ids_and_defers_stop_strings():
    vocab = 29
    params = SamplingParams(max_new_tokens=10, min_tokens=4, stop_token_ids=[7], stop=["b"])
    choice = TokenChoice(params, Letters(), {EOS})
    raw = torch.zeros(vocab)
    adjusted = choice._adjust(raw)
    assert adjusted[EOS] == float("-inf") and adjusted[7] == float("-inf")
    assert torch.equal(adjusted[[i for i in range(vocab) if i not in (EOS, 7)]], torch.zeros(vocab - 2))
    # the model wants EOS, then "b" (id 1): neither ends the answer before 4 tokens
    wanted = [EOS, 1, 7, 3, 1, 4]
    for position, want in enumerate(wanted):
        logits = torch.zeros(vocab)
        logits[want] = 5.0
        logits[5] = 1.0
        choice.choose(logits, position)
        if choice.done:
            break
    assert choice.token_ids == [5, 1, 5, 3, 1]  # EOS and 7 masked; "b" at 2 ignored; "b" at 5 stops
    assert choice.finish_reason == "stop"
    assert choice.text() == "fbfd"  # cut at the "b" that ended it, not the first one
    again = TokenChoice(params, Letters(), {EOS})
    for position, token in enumerate([3, 3, 3, 3, EOS]):
        logits = torch.zeros(vocab)
        logits[token] = 5.0
        again.choose(logits, position)
    assert again.finish_reason == "eos" and len(again.token_ids) == 5


def test_ignore_eos_neither_masks_nor_stops():
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, min_tokens=2)
    choice = TokenChoice(params, Letters(), {EOS})
    logits = torch.zeros(11)
    logits[EOS] = 5.0
    assert choice._adjust(logits)[EOS] == 5.0
    for position in range(3):
        choice.choose(logits, position)
    assert choice.token_ids == [EOS] * 3 and choice.finish_reason == "length"
    assert choice.text() == ""
    shown = TokenChoice(dataclasses.replace(params, skip_special_tokens=False), Letters(), {EOS})
    for position in range(3):
        shown.choose(logits, position)
    assert shown.text() == "</s></s></s>"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids_and_include_stop_str_in_output(include):
    params = SamplingParams(max_new_tokens=9, stop_token_ids=[6], stop=["de"], include_stop_str_in_output=include)
    choice = TokenChoice(params, Letters(), {EOS})
    for position, token in enumerate([1, 6, 9]):
        logits = torch.zeros(13)
        logits[token] = 1.0
        choice.choose(logits, position)
        if choice.done:
            break
    assert choice.token_ids == [1, 6] and choice.finish_reason == "stop"
    assert choice.text() == ("bg" if include else "b")
    strings = TokenChoice(params, Letters(), {EOS})
    for position, token in enumerate([0, 1, 3, 4, 5]):
        logits = torch.zeros(13)
        logits[token] = 1.0
        strings.choose(logits, position)
        if strings.done:
            break
    assert strings.token_ids == [0, 1, 3, 4]
    assert strings.text() == ("bde" if include else "b")  # id 0 is special: skipped


# ---------------------------------------------------------------- in the engine (tiny Llama)

from test_engine import PROMPTS, tiny_llama, tokenizer  # noqa: E402,F401  (fixture)
from test_lookahead import engines  # noqa: E402,F401  (fixture)
from test_batching import run_threads  # noqa: E402

EXTRAS = [dict(repetition_penalty=1.3), dict(repetition_penalty=0.8, min_tokens=6),
          dict(temperature=0.9, top_k=5, min_p=0.05, seed=3, repetition_penalty=1.2)]


def test_drafts_with_a_repetition_penalty_give_the_answer_of_no_drafts(engines):  # noqa: F811
    plain, ahead = engines
    ahead.scheduler.counters.clear()
    # 1.05: drafts are proposed and accepted (a strong penalty stops the repeats they copy);
    # verifying them on raw logits instead of the request's fails on these prompts
    for name in ("params-short", "scaffold-part", "nested-some"):
        for extra in (dict(repetition_penalty=1.05), dict(repetition_penalty=0.8, min_tokens=6)):
            params = SamplingParams(max_new_tokens=24, **extra)
            want = plain.generate(PROMPTS[name], params)
            got = ahead.generate(PROMPTS[name], params)
            assert got.token_ids == want.token_ids and got.text == want.text
            assert got.finish_reason == want.finish_reason
            assert params.min_tokens <= len(got.token_ids)
            free = plain.generate(PROMPTS[name], SamplingParams(max_new_tokens=24))
            if extra.get("repetition_penalty", 1.0) > 1:
                assert got.token_ids != free.token_ids, "the penalty must change this greedy answer"
    assert ahead.scheduler.counters["draft_accepted"] > 0


def test_extras_batched_equal_alone(engines):  # noqa: F811
    plain, _ = engines
    jobs = [(name, SamplingParams(max_new_tokens=16, **extra)) for name in ("all-of-union-one", "other-member")
            for extra in EXTRAS]
    alone = [plain.generate(PROMPTS[name], params).token_ids for name, params in jobs]
    together: list = [None] * len(jobs)

    def work(i):
        together[i] = plain.generate(PROMPTS[jobs[i][0]], jobs[i][1]).token_ids

    run_threads(len(jobs), work)
    assert together == alone
