"""The static-shape step (issue 41, item 3): bucketed shapes in static buffers equal the dynamic step.

``step_graphs="static"`` pads a step's new tokens to a power of two and its key extent to a row
bucket, writes every input into preallocated buffers (NaN- and garbage-poisoned before every step
here, so an entry the step uses but does not write shows), and masks the extra rows; on CUDA the
same step is what a graph captures. It must answer as the dynamic step does: greedy tokens equal,
and logits within ``TOL`` — fp32 rounding, as batching (the extra masked keys lengthen softmax's
reductions and the padded queries change the matmuls' row counts).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pckernels.engine import PromptCache
from pckernels.engine.config import EngineConfig
from pckernels.errors import OptionError
from pckernels.engine.graphs import StaticStep, StepGraphs, row_bucket, token_bucket
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (fixture)

TOL = 1e-4
"""fp32 max-abs on first logits and on every chosen token's log-probability (measured: ~1e-6)."""
NAMES = ["all-of-union-one", "other-member", "none", "params-short", "nested", "nested-some", "scaffold-all"]


def test_buckets():
    assert [token_bucket(q) for q in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert row_bucket(1, 256, 64) == 64
    assert row_bucket(65, 256, 64) == 128
    assert row_bucket(200, 256, 64) == 256
    assert row_bucket(300, 256, 64) == 256  # never past the arena
    assert row_bucket(5125, 8192, 64) == 5632  # 1/8th grain past 8 * min_rows
    assert all(e <= row_bucket(e, 1 << 20, 64) <= e + e // 8 + 64 for e in range(1, 20000, 37))


def test_options_are_checked_before_anything_runs(tokenizer):  # noqa: F811
    with pytest.raises(ValueError, match="step_graphs mode"):
        StepGraphs("sometimes")
    with pytest.raises(ValueError, match="max_tokens"):
        StepGraphs("static", max_tokens=0)
    with pytest.raises(TypeError):
        StepGraphs.of(3)
    assert StepGraphs().resolved(torch.device("cpu")) == "off"
    assert StepGraphs().resolved(torch.device("cuda")) == "captured"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        PromptCache(tiny_llama(len(tokenizer)), tokenizer, step_graphs="captured")
    with pytest.raises(OptionError) as refused:
        EngineConfig(step_graphs="sometimes")
    assert refused.value.option == "step_graphs"
    with pytest.raises(OptionError, match="needs a CUDA device"):
        EngineConfig(device="cpu", step_graphs="captured")
    assert EngineConfig(step_graphs="static").step_graphs == StepGraphs("static")
    assert EngineConfig().step_graphs == StepGraphs()


def run_mixed(pc: PromptCache) -> dict:
    """Requests joining and leaving: a first wave of different lengths, a second one joining while
    the first decodes; greedy with drafts, one sampled with a seed; logprobs of every token."""
    results: dict = {}
    errors: list = []

    def one(name, tokens, delay, **options):
        try:
            time.sleep(delay)
            results[name, tokens] = pc.generate(PROMPTS[name], max_new_tokens=tokens, logprobs=0, **options)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    jobs = [(name, 6 + 5 * (i % 4), 0.0 if i < 4 else 0.3, {}) for i, name in enumerate(NAMES)]
    jobs.append(("none", 13, 0.1, {"temperature": 0.8, "seed": 7}))
    jobs.append(("scaffold-by-name", 48, 0.0, {}))  # goes on alone after the others left
    threads = [threading.Thread(target=one, args=(n, t, d), kwargs=o) for n, t, d, o in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def both(tokenizer):  # noqa: F811
    """The mixed workload on the dynamic step and on the static one (buffers poisoned each step)."""
    loads = []
    original = StaticStep.load

    def poisoned_load(self, ids, positions, rows, keep, extent):
        self.poison_()
        out = original(self, ids, positions, rows, keep, extent)
        loads.append((len(ids), extent, out[0].shape[1], out[4].shape[1]))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(StaticStep, "load", poisoned_load)
    out = {}
    try:
        for mode in ("off", "static"):
            pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema", lookahead=3,
                             step_graphs=StepGraphs(mode, max_tokens=64, min_rows=16))
            pc.add_schema(SCHEMA)
            pc.evict_resident()
            runner = pc.scheduler.runner
            out[mode] = (run_mixed(pc), runner.arena.growths, runner.static, pc.scheduler.counters["draft_tokens"])
            pc.close()
    finally:
        mp.undo()
    return out, loads


def test_the_static_step_answers_as_the_dynamic_one(both):
    out, loads = both
    dynamic, _, none, _ = out["off"]
    static, growths, step, drafts = out["static"]
    assert none is None and step is not None
    assert drafts > 0 and growths >= 1
    assert dynamic.keys() == static.keys()
    for key, want in dynamic.items():
        got = static[key]
        assert got.token_ids == want.token_ids, key
        assert torch.isfinite(got.first_logits).all()
        assert (got.first_logits - want.first_logits).abs().max().item() <= TOL, key
        assert len(got.logprobs) == len(want.logprobs)
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, want.logprobs)) <= TOL, key


def test_the_static_steps_were_padded_and_bucketed(both):
    _, loads = both
    assert len(loads) > 20
    assert any(qb > q for q, _, qb, _ in loads)  # padded queries
    assert any(eb > extent for _, extent, _, eb in loads)  # masked extra rows
    assert any(q > 1 for q, *_ in loads) and any(q <= 4 for q, *_ in loads)  # batched and alone
    assert all(qb == token_bucket(q) and eb >= extent for q, extent, qb, eb in loads)


def test_a_step_past_the_largest_bucket_runs_dynamic(tokenizer):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema",
                     step_graphs=StepGraphs("static", max_tokens=2))
    pc.add_schema(SCHEMA)
    want = pc.generate(PROMPTS["nested"], max_new_tokens=3, mode="cached")
    static = pc.scheduler.runner.static
    assert static is not None and static.fits(2, 1) and not static.fits(3, 1)
    pc.close()
    ref = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema", step_graphs="off")
    ref.add_schema(SCHEMA)
    got = ref.generate(PROMPTS["nested"], max_new_tokens=3, mode="cached")
    ref.close()
    assert got.token_ids == want.token_ids
    assert (got.first_logits - want.first_logits).abs().max().item() <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_captured_step_answers_as_the_dynamic_one_on_cuda(tokenizer):  # noqa: F811
    """On a GPU: the same mixed workload replayed from CUDA graphs, against exact shapes (fp32)."""
    out = {}
    for mode in ("off", "captured"):
        pc = PromptCache(tiny_llama(len(tokenizer)).cuda(), tokenizer, device="cuda", placement="schema",
                         lookahead=3, step_graphs=StepGraphs(mode, max_tokens=64, min_rows=16))
        pc.add_schema(SCHEMA)
        out[mode] = run_mixed(pc), pc.scheduler.runner.static
        pc.close()
    (dynamic, _), (captured, step) = out["off"], out["captured"]
    assert step is not None and step.failed is None, step.failed if step else None
    assert step.captures > 0 and step.replays > step.captures
    for key, want in dynamic.items():
        got = captured[key]
        assert got.token_ids == want.token_ids, key
        assert (got.first_logits - want.first_logits).abs().max().item() <= TOL, key


def test_a_capture_that_fails_is_logged_once_and_the_step_runs_eager(tokenizer, caplog):  # noqa: F811
    """Capture breaking (here: no CUDA at all, forced past the option check) names the exception
    and where it was raised, once; every step still answers, with static shapes."""
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema", step_graphs="static")
    pc.add_schema(SCHEMA)
    want = pc.generate(PROMPTS["nested"], max_new_tokens=4)
    pc.scheduler.runner.graph_mode = "captured"
    pc.evict_resident()
    with caplog.at_level("WARNING", logger="pckernels.engine.graphs"):
        got = pc.generate(PROMPTS["nested"], max_new_tokens=4)
    static = pc.scheduler.runner.static
    pc.close()
    assert static.capture and static.failed is not None and static.captures == 0
    failures = [r for r in caplog.records if "capture" in r.getMessage()]
    assert len(failures) == 1 and " at " in failures[0].getMessage() and static.failed in failures[0].getMessage()
    assert got.token_ids == want.token_ids
    assert (got.first_logits - want.first_logits).abs().max().item() <= TOL
