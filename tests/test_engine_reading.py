"""Plain prompts read a few chunks per step beside decoding requests (docs/engine.md, "Fairness").

The arena runner restores a plain prompt's stored prefix at admission and reads the rest in whole
chunks, at most ``step_tokens`` prompt tokens per step across every reader (oldest first), each
chunk a forward of its own over the prompt's rows as a cold read does it — so the answer is
bitwise the one read alone and the one read without reuse, while requests already decoding emit a
token every step. A request cancelled while its prompt is read stops between two chunks and gives
its rows back. Each prompt chooses its first token the moment it is read, not after the step's
other prompts (``runner.Emit``).
"""

from __future__ import annotations

import pytest
import torch

from types import SimpleNamespace

from pckernels.engine import arena_runner
from pckernels.engine.runner import PromptBudget
from pckernels.engine.step import plan_step
from pckernels.errors import RequestCancelled
from test_batching import run_threads
from test_engine_prefix import BLOCK, doc, engine, same
from test_families import tokenizer  # noqa: F401  (fixture)

STEP = 2 * BLOCK
LONG = 13 * BLOCK + 5
"""A prompt of 14 chunks: 7 steps of ``STEP`` tokens."""


def test_the_budget_hands_out_whole_pieces_oldest_first():
    budget = PromptBudget(40)
    assert budget.take(100, 16) == 32  # whole chunks within the budget
    assert budget.take(5, 16) == 5  # a short rest fits what is left
    assert budget.take(100, 16) == 0  # no whole chunk fits: waits for the next step
    assert budget.take(3) == 3  # a PML piece is cut to the token
    assert budget.take(100) == 0
    first = PromptBudget(10)
    assert first.take(100, 16) == 16  # the first reader of a step always reads a piece
    assert first.take(100, 1) == 0
    whole = PromptBudget(8)
    assert whole.take(20, 20) == 20  # a prompt read in one forward goes in a step of its own
    assert PromptBudget(8).take(0, 16) == 0


def _request(new: int, *, prefilled: int = 0, reading=None, pending=None):
    """What ``plan_step`` reads of an ``ArenaRequest``."""
    return SimpleNamespace(new_tokens=list(range(new)), new_positions=list(range(new)), rows=list(range(new + 8)),
                           prefilled=prefilled, in_prompt=prefilled < new, reading=reading, pending=pending,
                           live=None, next_pos=new, decoded_rows=0)


def test_pml_pieces_and_plain_prompts_share_one_budget_oldest_first():
    decoding = _request(5, prefilled=5, pending=7)
    pml = _request(40)
    plain = _request(100, reading=SimpleNamespace(left=100, chunk=16))
    younger = _request(30)
    items, reads = plan_step([decoding, pml, plain, younger], PromptBudget(50), lambda active: [])
    assert [(item.active, len(item.tokens), item.decode) for item in items] == [
        (decoding, 1, True), (pml, 40, False), (younger, 10, False)]
    assert reads == [], "no whole chunk fits the 10 tokens the older prompt left"
    items, reads = plan_step([plain, pml], PromptBudget(50), lambda active: [])
    assert reads == [(plain, 48)] and [len(item.tokens) for item in items] == [2]


def streams(pc, count: int, new: int = 60) -> list:
    """``count`` plain requests already decoding (each has chosen its first token)."""
    handles = [pc.submit(pc.complete_request(doc(pc.tokenizer, 50 + i, 20), max_new_tokens=new))
               for i in range(count)]
    for handle in handles:
        next(iter(handle))
    return handles


def trace_steps(pc, long_handle) -> list:
    """Before each step of ``pc``'s runner: ``(tokens the long prompt has read, None once read,
    [tokens chosen by every other running request])``."""
    runner = pc.scheduler.runner
    step = runner.step
    log = []

    def traced(running, step_tokens, drafts, emit):
        reading = next((a.reading for a in running if a.handle is long_handle), None)
        log.append((None if reading is None else reading.position,
                    {a.handle.id: len(a.token_ids) for a in running if a.handle is not long_handle}))
        return step(running, step_tokens, drafts, emit)

    runner.step = traced
    return log


def test_a_long_prompt_is_read_in_chunks_while_others_decode_and_stays_exact(tokenizer):  # noqa: F811
    pc = engine(tokenizer, step_tokens=STEP)
    prompt = doc(tokenizer, 1, LONG)
    off = pc.complete(prompt, max_new_tokens=6, reuse=False)
    others = streams(pc, 3)
    with pc.model_lock:  # traced from its first step on
        handle = pc.submit(pc.complete_request(prompt, max_new_tokens=6))
        log = trace_steps(pc, handle)
    cold = handle.result(timeout=120)
    assert same(cold, off) and cold.cached_tokens == 0
    reading = [(read, chosen) for read, chosen in log if read is not None]
    assert len(reading) >= LONG // STEP, "the prompt must be read over several steps"
    reads = [read for read, _ in reading]
    assert reads == sorted(reads) and all(b - a <= STEP for a, b in zip(reads, reads[1:]))
    for (_, before), (_, after) in zip(reading, reading[1:]):
        assert all(after[i] == before[i] + 1 for i in before if i in after), \
            "every decoding request chooses a token in every step the long prompt is read in"
    for other in others:
        other.result(timeout=120)
    # a hit (its first blocks stored by the cold read) read the same way gives the same bits
    edited = prompt[:LONG - 40] + doc(tokenizer, 2, 40)
    off = pc.complete(edited, max_new_tokens=6, reuse=False)
    others = streams(pc, 2)
    hit = pc.complete(edited, max_new_tokens=6)
    assert same(hit, off) and hit.cached_tokens == (LONG - 40) // BLOCK * BLOCK
    for other in others:
        other.result(timeout=120)
    assert pc.scheduler.arena.referenced_rows() == 0


def test_a_request_cancelled_while_its_prompt_is_read_stops_between_chunks(tokenizer):  # noqa: F811
    pc = engine(tokenizer, step_tokens=8 * BLOCK)
    prompt = doc(tokenizer, 3, LONG)
    want = pc.complete(prompt, max_new_tokens=4, reuse=False)
    prefix = pc.prefix
    forward = prefix.forward_chunk
    chunks = []
    handle = None

    def counted(cache, ids, first):
        chunks.append(first)
        if len(chunks) == 2:
            handle.cancel()
        return forward(cache, ids, first)

    with pc.model_lock:
        handle = pc.submit(pc.complete_request(prompt, max_new_tokens=4))
        prefix.forward_chunk = counted
    with pytest.raises(RequestCancelled):
        handle.result(timeout=60)
    prefix.forward_chunk = forward
    assert chunks == [0, BLOCK], "no chunk is read after the request was cancelled"
    assert pc.scheduler.arena.referenced_rows() == 0
    assert pc.stats()["engine"]["cancelled"] == 1
    # what it completed is stored and held by no one; the prompt reads on from there exactly
    again = pc.complete(prompt, max_new_tokens=4)
    assert again.cached_tokens == 2 * BLOCK and same(again, want)


def test_many_threads_reading_long_prompts_equal_the_serial_answers(tokenizer):  # noqa: F811
    pc = engine(tokenizer, step_tokens=STEP)
    shared = doc(tokenizer, 4, 5 * BLOCK)
    prompts = [shared + doc(tokenizer, 10 + i, 3 * BLOCK + 7 * i) if i % 2 else doc(tokenizer, 10 + i, 4 * BLOCK + i)
               for i in range(6)]
    serial = [pc.complete(p, max_new_tokens=5, reuse=False) for p in prompts]
    results = {}

    def work(i):
        results[i] = [pc.complete(prompts[i], max_new_tokens=5), pc.complete(prompts[(i + 1) % 6], max_new_tokens=5)]

    run_threads(6, work)
    for i, (first, second) in results.items():
        assert same(first, serial[i]) and same(second, serial[(i + 1) % 6])
    assert pc.scheduler.arena.referenced_rows() == 0
    assert sum(n for size, n in pc.scheduler.batch_sizes.items() if size > 1) > 0


def trace_outputs(pc, runner_module, monkeypatch) -> list:
    """What ``pc``'s scheduler does, in order: ``("step",)`` as a step starts, ``("read", id)`` as a
    request reads its share of the step, ``("first", id)`` / ``("token", id)`` as the scheduler
    chooses from a prompt's first logits / a decode item's (``runner_module``: the runner's
    module, whose ``read_prompt`` is traced)."""
    scheduler = pc.scheduler
    runner = scheduler.runner
    step, output, read = runner.step, scheduler._output, runner_module.read_prompt
    events = []

    def traced_step(*args):
        events.append(("step",))
        return step(*args)

    def traced_output(out, ended):
        events.append(("first" if out.tokens is None else "token", out.active.handle.id))
        output(out, ended)

    def traced_read(active, tokens):
        events.append(("read", active.handle.id))
        return read(active, tokens)

    monkeypatch.setattr(runner, "step", traced_step)
    monkeypatch.setattr(scheduler, "_output", traced_output)
    monkeypatch.setattr(runner_module, "read_prompt", traced_read)
    return events


def step_of(events: list, event: tuple) -> list:
    """The events of the step ``event`` happened in."""
    at = events.index(event)
    start = max(i for i in range(at + 1) if events[i] == ("step",))
    end = next((i for i in range(at, len(events)) if events[i] == ("step",)), len(events))
    return events[start + 1:end]


def assert_first_tokens_as_read(events: list, decoding: list, prompts: list) -> None:
    """In the step that read ``prompts`` (handles, oldest first): the ``decoding`` streams' tokens
    were chosen before any prompt was read, and each prompt's first token before the next prompt
    read anything."""
    ids = [handle.id for handle in prompts]
    step = step_of(events, ("read", ids[0]))
    order = [e for e in step if e[0] in ("read", "first") and e[1] in ids]
    assert order == [e for i in ids for e in (("read", i), ("first", i))], \
        "every prompt read in one step, each choosing its first token before the next is read"
    first_read = step.index(("read", ids[0]))
    for handle in decoding:
        assert step.index(("token", handle.id)) < first_read, "a decode token is chosen right after its forward"


def test_each_prompt_chooses_its_first_token_as_soon_as_it_is_read(tokenizer, monkeypatch):  # noqa: F811
    """Three cold prompts admitted at once and read in one step beside a decoding stream: the
    first's token is chosen before the second is read (one of them ends at that token and gives its
    rows back mid-step, one forks two answers mid-step); every answer equals the one read alone."""
    pc = engine(tokenizer)
    prompts = [doc(tokenizer, 70 + i, 3 * BLOCK + 2 + i) for i in range(3)]
    sampling = [dict(max_new_tokens=1), dict(max_new_tokens=5, n=2), dict(max_new_tokens=5)]
    alone = [pc.complete(p, max_new_tokens=s["max_new_tokens"], reuse=False) for p, s in zip(prompts, sampling)]
    decoding = streams(pc, 1, new=1000)

    def submit():  # on the scheduler thread between two steps: the next step admits all three, traced
        handles = [pc.submit(pc.complete_request(p, **s)) for p, s in zip(prompts, sampling)]
        return handles, trace_outputs(pc, arena_runner, monkeypatch)

    handles, events = pc.scheduler.call(submit)
    answers = [handles[0].result(timeout=120), *(h.result(timeout=120) for h in handles[1].choices),
               handles[2].result(timeout=120)]
    for handle in decoding:  # long enough to decode through the traced step, whoever gets the lock when
        handle.cancel()
        with pytest.raises(RequestCancelled):
            handle.result(timeout=120)
    want = [alone[0], alone[1], alone[1], alone[2]]
    assert all(same(a, b) for a, b in zip(answers, want))
    assert_first_tokens_as_read(events, decoding, handles)
    assert pc.scheduler.arena.referenced_rows() == 0


def test_every_step_is_counted_even_one_that_only_reads_chunks(tokenizer):  # noqa: F811
    """A prompt read alone over 7 steps of 2 chunks, then one decode: 8 steps, each in ``steps``
    (the steps before its last chunk emit nothing) and in ``batch_sizes``."""
    pc = engine(tokenizer, step_tokens=STEP)
    before = pc.scheduler.counters["steps"]
    pc.complete(doc(tokenizer, 5, LONG), max_new_tokens=2, reuse=False)
    assert pc.scheduler.counters["steps"] - before == -(-LONG // STEP) + 1
    assert sum(pc.scheduler.batch_sizes.values()) == pc.scheduler.counters["steps"]
