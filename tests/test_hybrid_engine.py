"""The engine serves models with recurrent layers: plain prompts, exact prefix reuse, batching, drafts.

Tiny random hybrids (attention + SSM / gated delta net / short convolution) and a pure SSM. Reuse on
must equal reuse off bitwise (first logits) and token for token; requests decoding together must
equal the same requests alone; a decode step that verifies a draft must leave no trace of the
rejected tokens; PML is refused and changes nothing; cancelling a request in the middle of its
prompt leaks nothing into the next.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pckernels import PMLError, PromptTooLongError
from pckernels.engine import PromptCache
from pckernels.errors import DeadlineExceeded, RequestCancelled, RequestTooLargeError
from pckernels.prefix.testing import TINY_CONFIGS, tiny_model, tiny_tokenizer

BLOCK = 16
NEW = 6
HYBRIDS = [name for name in TINY_CONFIGS if name != "llama"]
DOC = ("Doc 3. You answer questions about how bees choose a new nest. Scouts dance for sites they found; "
       "the swarm moves when enough scouts dance for one site. Be brief, be exact, cite the text.")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def chat(*turns: str) -> list[dict]:
    messages = [{"role": "system", "content": DOC}]
    for index, text in enumerate(turns):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return messages


def engine(tokenizer, family: str = "qwen3_next", **options) -> PromptCache:
    return PromptCache(tiny_model(family, len(tokenizer)), tokenizer, prefix_block_size=BLOCK, **options)


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits)


@pytest.mark.parametrize("family", HYBRIDS)
def test_every_family_reuses_prefixes_exactly(tokenizer, family):
    """First pass, repeat, middle edit (first and repeated), next turn: each equal to reuse off."""
    pc = engine(tokenizer, family)
    if not pc.prefix.reuse_supported:
        pytest.skip(f"{family}: reuse refused with this transformers version: {pc.prefix.refusal}")
    edited = [dict(m) for m in chat("What do scouts do?")]
    edited[0]["content"] = DOC.replace("bees", "wasps")
    cases = [chat("What do scouts do?"), chat("What do scouts do?"), edited, edited,
             chat("What do scouts do?", "They dance.", "When does the swarm move?")]
    hits = []
    for messages in cases:
        off = pc.complete(messages, max_new_tokens=NEW, reuse=False)
        on = pc.complete(messages, max_new_tokens=NEW)
        assert same(on, off) and on.mode == "prefix" and off.mode == "uncached"
        hits.append(on.cached_tokens)
    assert hits[1] == len(pc.complete_request(cases[1]).prompt_token_ids), "an exact repeat reads nothing"
    assert 0 < hits[2] < hits[3], "an edit reuses what comes before it, then itself"
    assert hits[4] >= (hits[1] - 1) // BLOCK * BLOCK - BLOCK, "the next turn reuses the previous prompt's blocks"
    pc.close()


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "falcon_h1"])
def test_requests_decoding_together_equal_alone(tokenizer, family):
    """Six threads at once (prompts read alone, decoding batched row by row) give what each gives alone."""
    pc = engine(tokenizer, family)
    prompts = [chat(f"Question {i}: " + "what happens next? " * (i + 1)) for i in range(6)]
    alone = [pc.complete(p, max_new_tokens=NEW + 2 * i, reuse=False) for i, p in enumerate(prompts)]
    results: dict[int, object] = {}

    def ask(index: int) -> None:  # rows leave the batch at different steps
        results[index] = pc.complete(prompts[index], max_new_tokens=NEW + 2 * index, reuse=False)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, reference in enumerate(alone):
        assert results[index].token_ids == reference.token_ids
        assert torch.equal(results[index].first_logits, reference.first_logits), "prompts are read alone"
    assert max(pc.scheduler.batch_sizes) > 1 and pc.stats()["engine"]["batch_rebuilds"] > 1
    pc.close()


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "falcon_h1", "jamba"])
def test_drafts_leave_no_trace_in_recurrent_states(tokenizer, family):
    """Lookahead on equals lookahead off, token for token, with drafts rejected along the way."""
    model = tiny_model(family, len(tokenizer))
    prompts = ["abc abc abc abc abc abc abc abc abc", "the tide the tide the tide the tide the", "xyzxyzxyzxyzxyzxyz"]
    plain = PromptCache(model, tokenizer, prefix_block_size=BLOCK)
    reference = [plain.complete(p, max_new_tokens=24, reuse=False) for p in prompts]
    plain.close()
    drafting = PromptCache(model, tokenizer, prefix_block_size=BLOCK, lookahead=4)
    for p, ref in zip(prompts, reference):
        got = drafting.complete(p, max_new_tokens=24)
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
        assert torch.equal(got.first_logits, ref.first_logits)
    stats = drafting.stats()["engine"]
    assert stats["draft_tokens"] >= stats["draft_accepted"] > 0
    drafting.close()


def test_a_rejected_draft_is_rewound(tokenizer):
    """Every draft wrong: each step puts the states back and re-reads the pending token, and the
    answer still equals the undrafted one."""
    model = tiny_model("qwen3_next", len(tokenizer))
    reference = PromptCache(model, tokenizer, prefix_block_size=BLOCK).complete(DOC, max_new_tokens=12)
    pc = PromptCache(model, tokenizer, prefix_block_size=BLOCK, lookahead=3)
    pc.scheduler.decoding.drafts = lambda active: [(active.pending + 1) % len(tokenizer)]
    got = pc.complete(DOC, max_new_tokens=12)
    assert got.token_ids == reference.token_ids
    assert pc.stats()["engine"]["draft_rewinds"] >= len(got.token_ids) - 2
    pc.close()


def test_pml_is_refused_and_changes_nothing(tokenizer):
    pc = engine(tokenizer, "lfm2")
    before = pc.complete(chat("Hi"), max_new_tokens=NEW)
    for attempt in (lambda: pc.add_schema('<schema name="s"><module name="m">hi</module></schema>'),
                    lambda: pc.generate('<prompt schema="s"><m/><user>hi</user></prompt>'),
                    lambda: pc.request('<prompt schema="s"><m/></prompt>'),
                    lambda: pc.block_key(None, "m")):
        with pytest.raises(PMLError, match="recurrent layers"):
            attempt()
    assert pc.schemas == {} and len(pc.store) == 0
    assert same(pc.complete(chat("Hi"), max_new_tokens=NEW), before)
    pc.close()


def test_a_request_cancelled_while_reading_its_prompt_leaks_nothing(tokenizer):
    """A long prompt read a chunk per step is cancelled half-way: it fails with RequestCancelled,
    holds nothing afterwards, and the same prompt then reads exactly."""
    pc = engine(tokenizer, "qwen3_next", step_tokens=BLOCK)
    prompt = DOC * 12
    reference = pc.complete(prompt, max_new_tokens=NEW, reuse=False)
    chunks = pc.stats()["engine"]["prompt_chunks"]
    handle = pc.submit(pc.complete_request(prompt, max_new_tokens=NEW))
    deadline = time.monotonic() + 60
    while pc.stats()["engine"]["prompt_chunks"] < chunks + 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    handle.cancel()
    with pytest.raises(RequestCancelled):
        handle.result(timeout=60)
    engine_stats = pc.stats()["engine"]
    assert engine_stats["hybrid"]["admitted"] == 0 and engine_stats["running"] == 0
    stored = pc.prefix.stats()["bytes"]
    assert stored > 0 and pc.prefix.evict(1 << 40) == stored, "what it read is stored, and held by nobody"
    assert same(pc.complete(prompt, max_new_tokens=NEW), reference)
    pc.close()


def test_limits(tokenizer):
    """A prompt past the model's positions, a request larger than the budget, a deadline."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pckernels.prefix.testing import _HIDDEN

    config = AutoConfig.for_model("qwen3_next", vocab_size=len(tokenizer), max_position_embeddings=64,
                                  **{**_HIDDEN, **TINY_CONFIGS["qwen3_next"]})
    torch.manual_seed(0)
    pc = PromptCache(AutoModelForCausalLM.from_config(config).eval(), tokenizer, prefix_block_size=BLOCK)
    with pytest.raises(PromptTooLongError):
        pc.complete("x" * 80, max_new_tokens=4)
    short = pc.complete("x" * 40, max_new_tokens=40)
    assert short.finish_reason in ("length", "eos") and len(short.prompt_token_ids) + len(short.token_ids) <= 64
    pc.close()
    small = engine(tokenizer, "lfm2", kv_budget=4096)
    with pytest.raises(RequestTooLargeError):
        small.complete(DOC, max_new_tokens=8)
    small.close()
    slow = engine(tokenizer, "lfm2", step_tokens=BLOCK)
    with pytest.raises(DeadlineExceeded):
        slow.complete(DOC * 20, max_new_tokens=8, reuse=False, deadline_s=0.01)
    slow.close()


def test_n_answers_copy_the_states_of_one_reading(tokenizer):
    pc = engine(tokenizer, "qwen3_next")
    single = pc.complete(chat("What happens next?"), max_new_tokens=NEW, reuse=False)
    handle = pc.submit(pc.complete_request(chat("What happens next?"), max_new_tokens=NEW, reuse=False, n=3))
    answers = [h.result(timeout=60) for h in handle.choices]
    assert all(a.token_ids == single.token_ids and torch.equal(a.first_logits, single.first_logits) for a in answers)
    assert sum(a.computed_tokens for a in answers) == single.computed_tokens
    assert pc.stats()["engine"]["hybrid"]["admitted"] == 0
    pc.close()


def test_peak_is_kept_on_hybrid_models_as_on_the_arena(tokenizer):
    """``Scheduler.peak`` (the ``Runner`` protocol's) answers on a hybrid model: the busiest moment's
    requests and bytes, back to nothing after ``reset_peak``; the batch is built from the runner's
    own layer states, not the prefix cache's."""
    pc = engine(tokenizer, "lfm2")
    assert pc.scheduler.peak == {"requests": 0, "bytes": 0}
    with pc.model_lock:
        handles = [pc.submit(pc.complete_request(chat(f"Question {i}?"), max_new_tokens=NEW)) for i in range(3)]
    for handle in handles:
        handle.result(timeout=60)
    runner = pc.scheduler.runner
    peak = pc.scheduler.peak
    assert peak["requests"] == 3 and peak["bytes"] == runner._bytes(3, max(
        len(h.request.prefix.token_ids) for h in handles) + NEW)
    assert runner.states is not pc.prefix.states and runner.states.kinds == list(runner.footprint.kinds)
    pc.scheduler.reset_peak()
    assert pc.scheduler.peak == {"requests": 0, "bytes": 0}
    pc.close()


def test_each_prompt_chooses_its_first_token_as_soon_as_it_is_read(tokenizer, monkeypatch):
    """As on the arena (tests/test_engine_reading.py): three prompts read in one step beside a
    decoding request, each choosing its first token before the next is read; answers as alone."""
    from pckernels.engine import hybrid
    from test_engine_reading import assert_first_tokens_as_read, trace_outputs

    pc = engine(tokenizer, "qwen3_next")
    prompts = [chat(f"Question {i}: " + "what happens next? " * (i + 2)) for i in range(3)]
    alone = [pc.complete(p, max_new_tokens=NEW, reuse=False) for p in prompts]
    stream = pc.submit(pc.complete_request(chat("Tell me everything."), max_new_tokens=400, reuse=False,
                                           ignore_eos=True))
    next(iter(stream))

    def submit():  # on the scheduler thread between two steps: no wait for the model lock (a busy
        # scheduler may hold it until the stream ends), and the next step admits all three, traced
        handles = [pc.submit(pc.complete_request(p, max_new_tokens=NEW)) for p in prompts]
        return handles, trace_outputs(pc, hybrid, monkeypatch)

    handles, events = pc.scheduler.call(submit)
    answers = [h.result(timeout=120) for h in handles]
    stream.cancel()  # long enough to decode through the traced step
    with pytest.raises(RequestCancelled):
        stream.result(timeout=120)
    assert all(same(a, b) for a, b in zip(answers, alone))
    assert_first_tokens_as_read(events, [stream], handles)
    pc.close()
