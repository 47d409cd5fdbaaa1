"""Many requests at once: concurrent calls on one engine give what they give alone.

The scheduler packs the tokens of every running request into one forward over a shared KV arena;
batching changes reduction order (which rows sit next to which in attention, how many rows a
matmul has), so results agree with a request run alone to rounding — greedy tokens equal, fp32
first logits within ``BATCH_TOL`` — and bitwise for the exact prefix cache's first token, which is
prefilled alone. See docs/engine.md.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest
import torch

from pckernels.engine import PromptCache
from pckernels.errors import (DeadlineExceeded, EngineBusyError, PMLError, RequestCancelled,
                              RequestTooLargeError)
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (fixture)

BATCH_TOL = 1e-4
"""fp32 first-logit max-abs between a request batched with others and run alone (measured: ~1e-6)."""
NEW_TOKENS = 8
MODES = ("cached", "reference", "baseline")
NAMES = [n for n in PROMPTS if n != "params-missing"]


@pytest.fixture(scope="module")
def engine(tokenizer):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    return pc


@pytest.fixture(scope="module")
def alone(engine):
    """Every prompt in every mode, run one at a time from a clean arena."""
    out = {}
    for name, mode in itertools.product(NAMES, MODES):
        engine.evict_resident()
        out[name, mode] = engine.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS, mode=mode)
    return out


def assert_close(got, want, *, bitwise_first: bool = False) -> None:
    assert got.token_ids == want.token_ids
    assert torch.isfinite(got.first_logits).all()
    if bitwise_first:
        assert torch.equal(got.first_logits, want.first_logits)
    else:
        assert (got.first_logits - want.first_logits).abs().max().item() <= BATCH_TOL
    assert (got.cached_tokens, got.computed_tokens, got.mode) == (want.cached_tokens, want.computed_tokens, want.mode)


def run_threads(count: int, work) -> list:
    """``work(i)`` in ``count`` threads started together; their errors re-raised here."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def target(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # collected and re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    if errors:
        raise errors[0]
    return errors


def test_threads_times_calls_equal_the_serial_outputs(engine, alone):
    """4 threads x every prompt in rotating modes on one engine: each answer is its solo answer
    (before the scheduler this gave size-mismatch exceptions and silently wrong logits)."""
    results = {}
    batches_before = sum(n for size, n in engine.scheduler.batch_sizes.items() if size > 1)

    def work(i):
        for j, name in enumerate(NAMES):
            mode = MODES[(i + j) % len(MODES)]
            results[i, name, mode] = engine.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS, mode=mode)

    run_threads(4, work)
    assert len(results) == 4 * len(NAMES)
    for (_, name, mode), got in results.items():
        assert_close(got, alone[name, mode])
    batched = sum(n for size, n in engine.scheduler.batch_sizes.items() if size > 1) - batches_before
    assert batched > 0, "concurrent calls must share forwards"
    assert engine.scheduler.arena.referenced_rows() == 0


def test_interleaved_streams_in_one_thread(engine, alone):
    """Two ``stream()`` generators consumed alternately each give their own answer."""
    a = engine.stream(PROMPTS["all-of-union-one"], max_new_tokens=NEW_TOKENS)
    b = engine.stream(PROMPTS["nested"], max_new_tokens=NEW_TOKENS)
    texts = {"a": "", "b": ""}
    for pair in itertools.zip_longest(a, b, fillvalue=""):
        texts["a"] += pair[0]
        texts["b"] += pair[1]
    assert texts["a"] == alone["all-of-union-one", "cached"].text
    assert texts["b"] == alone["nested", "cached"].text


def test_a_batch_of_mixed_requests_equals_each_alone(engine, alone):
    """Requests that share some modules and not others, of different lengths, one finishing early
    and one cancelled, all submitted before the scheduler runs, so they share every step."""
    names = ["everything", "nested", "all-of-union-one", "other-member", "scaffold-all", "text-only"]
    with engine.model_lock:
        handles = {name: engine.submit(PROMPTS[name], max_new_tokens=NEW_TOKENS) for name in names}
        short = engine.submit(PROMPTS["nested-some"], max_new_tokens=2)
        doomed = engine.submit(PROMPTS["params-short"], max_new_tokens=NEW_TOKENS)
        doomed.cancel()
        steps = engine.scheduler.counters["steps"]
    for name, handle in handles.items():
        assert_close(handle.result(timeout=60), alone[name, "cached"])
    got = short.result(timeout=60)
    assert got.token_ids == alone["nested-some", "cached"].token_ids[:2] and got.finish_reason == "length"
    with pytest.raises(RequestCancelled):
        doomed.result(timeout=60)
    assert engine.scheduler.counters["steps"] - steps <= NEW_TOKENS + 1, "the requests did not share steps"
    assert engine.scheduler.arena.referenced_rows() == 0


def test_a_module_imported_by_many_requests_is_placed_once(tokenizer):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    prompt = PROMPTS["all-of-union-one"]
    with pc.model_lock:
        handles = [pc.submit(prompt, max_new_tokens=4) for _ in range(5)]
    for handle in handles:
        handle.result(timeout=60)
    imported = len([m for m in pc.resolve(prompt).modules if pc.schemas["guide"].modules[m].token_ids])
    assert pc.scheduler.counters["blocks_placed"] == imported
    assert pc.scheduler.batch_sizes[5] >= 1


def test_poisoned_free_rows_never_reach_a_batch(engine, alone):
    """Free arena rows poisoned (finite) before a batch: every request still equals its solo run."""
    engine.evict_resident()
    engine.scheduler.arena.poison_()
    with engine.model_lock:
        handles = {name: engine.submit(PROMPTS[name], max_new_tokens=NEW_TOKENS, mode=mode)
                   for name, mode in [("everything", "cached"), ("nested", "reference"), ("none", "baseline")]}
    for (name, mode) in [("everything", "cached"), ("nested", "reference"), ("none", "baseline")]:
        assert_close(handles[name].result(timeout=60), alone[name, mode])


def test_complete_joins_the_batch_and_keeps_its_exact_first_token(engine, alone):
    """Plain prompts prefill alone through the prefix cache (first logits bitwise equal with and
    without reuse) and decode in the same steps as PML requests."""
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a city."}]
    plain = engine.complete(messages, max_new_tokens=NEW_TOKENS, reuse=False)
    results = {}

    def work(i):
        if i % 2:
            results[i] = engine.complete(messages, max_new_tokens=NEW_TOKENS)
        else:
            results[i] = engine.generate(PROMPTS["everything"], max_new_tokens=NEW_TOKENS)

    run_threads(4, work)
    for i, got in results.items():
        if i % 2:
            assert got.token_ids == plain.token_ids and torch.equal(got.first_logits, plain.first_logits)
        else:
            assert_close(got, alone["everything", "cached"])


def test_cancel_frees_rows_and_ends_the_stream(tokenizer):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    handle = pc.submit(PROMPTS["everything"], max_new_tokens=500)
    tokens = iter(handle)
    next(tokens)
    handle.cancel()
    with pytest.raises(RequestCancelled) as err:
        list(tokens)
    assert 1 <= len(err.value.token_ids) < 500
    deadline = time.monotonic() + 10
    while pc.scheduler.arena.referenced_rows() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pc.scheduler.arena.referenced_rows() == 0
    assert pc.generate(PROMPTS["none"], max_new_tokens=2).token_ids


def test_closing_a_stream_early_cancels_its_request(tokenizer):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    stream = pc.stream(PROMPTS["everything"], max_new_tokens=500)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 10
    while pc.scheduler.counters["cancelled"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pc.scheduler.counters["cancelled"] == 1


def test_deadline_fails_the_request_with_what_it_had(tokenizer):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    with pc.model_lock:
        waiting = pc.submit(PROMPTS["none"], max_new_tokens=4, deadline_s=0.05)
        time.sleep(0.1)
    with pytest.raises(DeadlineExceeded):
        waiting.result(timeout=10)
    running = pc.submit(PROMPTS["everything"], max_new_tokens=100_000, deadline_s=0.5)
    with pytest.raises(DeadlineExceeded) as err:
        running.result(timeout=30)
    assert err.value.token_ids
    with pytest.raises(ValueError, match="deadline_s"):
        pc.submit(PROMPTS["none"], deadline_s=0)


def test_full_queue_is_a_clear_busy_error_and_changes_nothing(tokenizer):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, max_queue=1, placement="schema")
    pc.add_schema(SCHEMA)
    with pc.model_lock:
        first = pc.submit(PROMPTS["none"], max_new_tokens=2)
        with pytest.raises(EngineBusyError, match="max_queue=1"):
            pc.submit(PROMPTS["nested"], max_new_tokens=2)
        submitted = pc.scheduler.counters["submitted"]
    assert first.result(timeout=30).token_ids
    assert submitted == 1 and pc.stats()["engine"]["busy"] == 1


def test_a_request_that_can_never_fit_is_refused_at_once(tokenizer):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, kv_budget=64 * 256, placement="schema")
    pc.add_schema(SCHEMA)
    with pytest.raises(RequestTooLargeError, match="kv_budget"):
        pc.submit(PROMPTS["everything"], max_new_tokens=200)
    assert pc.scheduler.counters["submitted"] == 0
    assert pc.generate(PROMPTS["none"], max_new_tokens=2).token_ids


def test_requests_wait_for_room_under_a_small_budget(tokenizer, alone):  # noqa: F811
    """A KV budget for about one request at a time: the others wait for rows, then run; all exact."""
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, kv_budget=160 * 256, placement="schema")
    pc.add_schema(SCHEMA)
    names = ["everything", "nested", "all-of-union-one", "other-member"]
    handles = {name: pc.submit(PROMPTS[name], max_new_tokens=NEW_TOKENS) for name in names}
    for name, handle in handles.items():
        got = handle.result(timeout=60)
        assert got.token_ids == alone[name, "cached"].token_ids
    assert pc.scheduler.arena.capacity <= 160
    assert pc.scheduler.batch_sizes[4] == 0, "four requests never fit at once"


def test_bad_input_raises_in_the_caller_and_queues_nothing(engine):
    submitted = engine.scheduler.counters["submitted"]
    with pytest.raises(PMLError):
        engine.submit('<prompt schema="guide"><nope/></prompt>')
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(PROMPTS["none"], max_new_tokens=0)
    assert engine.scheduler.counters["submitted"] == submitted


def test_a_failing_request_does_not_take_others_down(tokenizer, monkeypatch):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    pc.evict_resident()
    fetch = pc.blocks.fetch_block

    def broken(schema, module, scaffold="", geometry="schema"):
        if module == "tokyo":
            raise OSError("block store unreachable")
        return fetch(schema, module, scaffold, geometry)

    monkeypatch.setattr(pc.blocks, "fetch_block", broken)
    with pc.model_lock:
        bad = pc.submit(PROMPTS["other-member"], max_new_tokens=2)
        good = pc.submit(PROMPTS["all-of-union-one"], max_new_tokens=2)
    with pytest.raises(OSError, match="unreachable"):
        bad.result(timeout=30)
    assert good.result(timeout=30).token_ids
    assert pc.scheduler.arena.referenced_rows() == 0


def test_a_bug_in_the_model_thread_fails_requests_instead_of_hanging_them(tokenizer, alone, monkeypatch):  # noqa: F811
    """An exception escaping the scheduler's own code (not one request's work) ends the requests in
    flight with an error naming it; the thread lives on and the next request answers exactly."""
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    admitted = pc.scheduler.runner.admitted

    def broken(active):
        raise TypeError("a bug in the runner")

    monkeypatch.setattr(pc.scheduler.runner, "admitted", broken)
    handle = pc.submit(PROMPTS["other-member"], max_new_tokens=3)
    with pytest.raises(RuntimeError, match="a bug in the runner"):
        handle.result(timeout=30)
    monkeypatch.setattr(pc.scheduler.runner, "admitted", admitted)
    got = pc.generate(PROMPTS["other-member"], max_new_tokens=NEW_TOKENS, mode="cached")
    assert_close(got, alone["other-member", "cached"])
    assert pc.scheduler.arena.referenced_rows() == 0
    pc.close()


def test_a_profiler_that_cannot_start_leaves_the_engine_answering(tokenizer, alone, caplog):  # noqa: F811
    """The perf suite's breakdown hands the scheduler a profiler; on Python 3.12+ a second cProfile
    refuses to start (ValueError). The step then runs unprofiled instead of killing the thread."""
    class Refusing:
        def enable(self):
            raise ValueError("Another profiling tool is already active")

        def disable(self):
            raise AssertionError("never enabled, never disabled")

    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    pc.scheduler.profiler = Refusing()
    with caplog.at_level(logging.WARNING, logger="pckernels.engine.scheduler"):
        got = pc.submit(PROMPTS["other-member"], max_new_tokens=NEW_TOKENS, mode="cached").result(timeout=60)
    assert_close(got, alone["other-member", "cached"])
    assert pc.scheduler.profiler is None  # dropped after the first refusal: one warning, not one per step
    assert sum("could not be enabled" in r.getMessage() for r in caplog.records) == 1
    pc.close()


@pytest.mark.parametrize("family", [f.name for f in __import__("family_models").FAMILIES])
def test_every_family_batches_exactly(tokenizer, family):  # noqa: F811
    """Three prompts with different modules and gaps in one packed forward per step, for every
    family (RoPE variants, sliding windows by position, ALiBi, learned positions): each equals its
    solo run."""
    from test_families import prompt_cache

    pc = prompt_cache(family, tokenizer)
    names = ["nested-some", "everything", "other-member"]
    solo = {}
    for name in names:
        pc.evict_resident()
        solo[name] = pc.generate(PROMPTS[name], max_new_tokens=4)
    pc.evict_resident()
    with pc.model_lock:
        handles = {name: pc.submit(PROMPTS[name], max_new_tokens=4) for name in names}
        batched = pc.scheduler.batch_sizes[3]
    for name, handle in handles.items():
        assert_close(handle.result(timeout=60), solo[name])
    assert pc.scheduler.batch_sizes[3] > batched


@pytest.mark.parametrize("kind", ["pml", "plain"])
def test_n_answers_share_one_reading_of_the_prompt(tokenizer, kind):  # noqa: F811
    """n > 1: the prompt is read once, every answer reads its rows and decodes on its own: greedy
    answers all equal the single answer, seeded samples equal single requests with seed + i, the
    prompt is computed once, and every row comes back."""
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)

    def make(**options):
        if kind == "pml":
            return pc.request(PROMPTS["all-of-union-one"], max_new_tokens=5, **options)
        return pc.complete_request("Tell me about rivers and bridges, " * 6, max_new_tokens=5, reuse=False, **options)

    single = pc.submit(make()).result()
    handle = pc.submit(make(n=3))
    assert len(handle.choices) == 3
    answers = [h.result(timeout=60) for h in handle.choices]
    assert all(a.token_ids == single.token_ids and torch.allclose(a.first_logits, single.first_logits, atol=1e-4)
               for a in answers)
    assert sum(a.computed_tokens for a in answers) == single.computed_tokens, "the prompt is read once"
    sampled = [h.result(timeout=60) for h in pc.submit(make(n=3, temperature=0.9, seed=5)).choices]
    alone = [pc.submit(make(temperature=0.9, seed=5 + i)).result() for i in range(3)]
    assert [s.token_ids for s in sampled] == [a.token_ids for a in alone]
    assert pc.scheduler.arena.referenced_rows() == 0
    with pc.model_lock:
        cancelled = pc.submit(make(n=2))
        cancelled.cancel()
    for h in cancelled.choices:
        with pytest.raises(RequestCancelled):
            h.result(timeout=60)
    assert pc.scheduler.arena.referenced_rows() == 0
