"""No host synchronisation on the request path (issue 41, item 2).

On CUDA every read of a device value on the host, every data-dependent size and every blocking
copy from pageable memory makes the host wait for the GPU. :mod:`sync_counter` counts those
constructs on the CPU path during one request; the engine's only one is the step's explicit
readout of the logits (``pckernels.engine.graphs.readout``, once per step for all its requests),
so a request makes no other, however long its modules and however many requests decode beside it.

Not counted, each for a stated reason (``EXEMPT``): the gather ops' torch path reads its *host*
table (``ops.gather_concat`` takes a host table and copies it to the device itself), and
``tensor.to(device)`` of a module buffer already on the device (HF's rotary embedding, the
native forward's frequencies) copies nothing; the native forward and ``visible_extents`` (long
masked forwards in query chunks) run on the CPU only — off the CPU attention is HF's SDPA. The first placement of a block makes its encoded
positions once (``engine/encoder.py``), so every test warms its blocks up first.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from pckernels.engine import PromptCache
from pckernels.generation.choice import TokenChoice
from pckernels.integration.attention import visible_extents
from sync_counter import SyncCounter
from test_engine import tiny_llama, tokenizer  # noqa: F401  (fixture)


def _lines_of(fn) -> tuple[str, ...]:
    """``"integration/<file>.py:<line>"`` for every line of ``fn`` (exempt by function, not by a line
    number that moves when the file above it changes)."""
    lines, first = inspect.getsourcelines(fn)
    name = "/".join(inspect.getsourcefile(fn).rsplit("/", 2)[-2:])
    return tuple(f"{name}:{first + i}" for i in range(len(lines)))


EXEMPT = ("gather_concat/__init__.py:", "gather_rotate/__init__.py:", "llama/modeling_llama.py:",
          "integration/native.py:", *_lines_of(visible_extents))
HOST = ((TokenChoice, "choose"),)
"""Token choice works on the logits after the readout: host tensors on CUDA too."""
SYNCS_PER_STEP = 0
"""Would-be syncs a step may make besides its one readout."""


def schema(tokenizer, tokens: int) -> str:
    words = " ".join(f"w{i % 97}" for i in range(tokens))
    ids = tokenizer(words)["input_ids"]
    text = tokenizer.decode(ids[:tokens])
    return f'<schema name="long{tokens}"><module name="doc">{text}</module></schema>'


def prompt(tokens: int, question: str = "Say something.") -> str:
    return f'<prompt schema="long{tokens}"><doc/><user>{question}</user><assistant/></prompt>'


@pytest.fixture(scope="module", params=["native", "hf"])
def engine(request, tokenizer):  # noqa: F811
    """The CPU path as it runs by default (native forward) and with HF's modules (what CUDA runs)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PROMPTCACHE_NATIVE", "1" if request.param == "native" else "0")
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    mp.undo()
    for tokens in (100, 1000):
        pc.add_schema(schema(tokenizer, tokens))
        pc.generate(prompt(tokens), max_new_tokens=2)  # blocks placed once: positions made
    yield pc
    pc.close()


def counted(pc: PromptCache, requests: list) -> tuple[SyncCounter, int]:
    """Run ``requests`` together from a clean arena; the counter and the steps they took."""
    pc.evict_resident()
    steps = pc.scheduler.counters["steps"]
    with SyncCounter(host=HOST, exempt=EXEMPT) as counter:
        handles = [pc.submit(r) for r in requests]
        for handle in handles:
            handle.result()
    return counter, pc.scheduler.counters["steps"] - steps


def test_a_request_waits_only_for_its_readouts_whatever_the_module_length(engine):
    seen = {}
    for tokens in (100, 1000):
        counter, steps = counted(engine, [engine.request(prompt(tokens), max_new_tokens=6)])
        assert steps >= 6
        assert counter.count <= SYNCS_PER_STEP * steps, counter.where
        assert counter.readouts == steps
        seen[tokens] = counter.count
    assert seen[100] == seen[1000]


def test_decoding_many_streams_waits_once_per_step(engine):
    seen = {}
    for streams in (1, 8):
        questions = [f"Question {i}?" for i in range(streams)]
        counter, steps = counted(engine, [engine.request(prompt(100, q), max_new_tokens=5) for q in questions])
        assert counter.count <= SYNCS_PER_STEP * steps, counter.where
        assert counter.readouts == steps  # one readout for all requests of a step
        assert steps < 5 * streams or streams == 1  # they did decode together
        seen[streams] = counter.count
    assert seen[1] == seen[8]


def test_a_plain_prompt_waits_only_for_its_readouts_cold_or_hit(engine):
    """Plain prompts (exact prefix reuse read into arena rows, the server's chats): read cold or
    resumed after stored blocks, 100 or 1,000 tokens, a request waits for its step readouts only —
    its ids and rows go to the device from pinned memory."""
    seen = {}
    for tokens in (100, 1000):
        base = [(7 * i) % 200 + 5 for i in range(tokens)]
        engine.complete(base, max_new_tokens=1)  # its blocks stored
        for label, ids in (("cold", [(13 * i + tokens) % 200 + 5 for i in range(tokens)]),
                           ("hit", base[:-3] + [9, 9, 9])):
            counter, steps = counted(engine, [engine.complete_request(ids, max_new_tokens=4)])
            assert steps >= 4 and counter.readouts == steps
            assert counter.count <= SYNCS_PER_STEP * steps, (label, tokens, counter.where)
            seen[tokens, label] = counter.count
    assert len(set(seen.values())) == 1, seen


def test_the_counter_sees_what_would_wait():
    """The counter itself: each construct counted once, only outside the opening thread."""
    import threading

    t = torch.arange(6)
    with SyncCounter() as counter:
        def work():
            int(t[1]), float(t[2]), bool(t[3]), t[1].item(), t.tolist(), t.cpu(), t.nonzero(), t[t > 2]
            torch.tensor([1, 2], device="cpu"), t.to("cpu"), t.to(torch.float32), t.to("cpu", non_blocking=True)
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        int(t[1])  # the caller's own thread: not the engine's
    assert counter.count == 10, counter.where


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_request_on_cuda_makes_no_hidden_sync(tokenizer, monkeypatch):  # noqa: F811
    """A PML request and two plain prompts (a hit and a cold read) under
    ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call but the step's readout
    raises in the scheduler thread and fails the request."""
    from pckernels.engine import graphs

    def allowed(original):
        """The readout, and a bucket's one-time capture (``torch.cuda.graph`` synchronises)."""
        def call(*args, **kwargs):
            torch.cuda.set_sync_debug_mode(0)
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        return call

    pc = PromptCache(tiny_llama(len(tokenizer)).cuda(), tokenizer, device="cuda", placement="schema")
    pc.add_schema(schema(tokenizer, 100))
    pc.generate(prompt(100), max_new_tokens=2)
    pc.evict_resident()
    monkeypatch.setattr(graphs, "readout", allowed(graphs.readout))
    monkeypatch.setattr(graphs.StaticStep, "_capture", allowed(graphs.StaticStep._capture))
    base = [(7 * i) % 200 + 5 for i in range(300)]
    pc.complete(base, max_new_tokens=1)  # a plain prompt's blocks stored
    requests = [pc.request(prompt(100), max_new_tokens=6), pc.complete_request(base[:-3] + [9, 9, 9], max_new_tokens=6),
                pc.complete_request([(13 * i) % 200 + 5 for i in range(300)], max_new_tokens=6)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [pc.submit(r).result() for r in requests]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        pc.close()
    assert [len(r.token_ids) for r in results] == [6, 6, 6]
    static = pc.scheduler.runner.static
    assert static is not None and static.failed is None and static.replays > 0
