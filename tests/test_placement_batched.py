"""Placement copies all of a request's new blocks in one launch per kind (issue 41, item 1/5b).

A request that imports several modules not yet resident gets them with one gather-concat (and one
gather-rotate for the moved blocks of compact placement) over all their tensors, not a launch per
block; the result is bitwise the per-block placement's; a block whose copy never happened (the
store failed on a later block) is not left resident.
"""

from __future__ import annotations

import pytest
import torch

from pckernels import ops
from pckernels.engine import PromptCache
from pckernels.engine.placement import Placer
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (fixture)


def spy(monkeypatch, name: str) -> list[int]:
    """Blocks per call of ``ops.<name>``."""
    calls: list[int] = []
    original = getattr(ops, name)

    def counted(out, blocks, *args, **kwargs):
        calls.append(len(blocks))
        return original(out, blocks, *args, **kwargs)

    monkeypatch.setattr(ops, name, counted)
    return calls


def one_at_a_time(monkeypatch):
    """The old way: a copy per block."""
    original = Placer._copy

    def per_block(self, pending):
        for entry in pending:
            original(self, [entry])

    monkeypatch.setattr(Placer, "_copy", per_block)


@pytest.mark.parametrize("placement,prompt,kind", [("schema", "everything", "gather_concat"),
                                                   ("compact", "nested-some", "gather_rotate")])
def test_one_launch_per_request_and_the_same_bits(tokenizer, monkeypatch, placement, prompt, kind):  # noqa: F811
    answers = []
    for batched in (True, False):
        with monkeypatch.context() as mp:
            if not batched:
                one_at_a_time(mp)
            concat, rotate = spy(mp, "gather_concat"), spy(mp, "gather_rotate")
            pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement=placement)
            pc.add_schema(SCHEMA)
            pc.evict_resident()
            before = pc.scheduler.counters["blocks_placed"]
            concat.clear()
            rotate.clear()  # encoding the schema gathered too
            answers.append(pc.generate(PROMPTS[prompt], max_new_tokens=4))
            placed = pc.scheduler.counters["blocks_placed"] - before
            moved = pc.scheduler.counters["blocks_moved"]
            pc.close()
        assert placed >= 2
        calls = concat + rotate
        assert sum(calls) == placed
        if batched:
            assert len(concat) <= 1 and len(rotate) <= 1
            assert (rotate if kind == "gather_rotate" else concat) and sum(rotate) == moved
            assert len(concat) == 1 and (len(rotate) == 1) == (kind == "gather_rotate")
        else:
            assert len(calls) == placed
    batched, alone = answers
    assert batched.token_ids == alone.token_ids
    assert torch.equal(batched.first_logits, alone.first_logits)


def test_a_failed_placement_leaves_no_block_behind(tokenizer, monkeypatch):  # noqa: F811
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    pc.evict_resident()
    want = pc.generate(PROMPTS["nested"], max_new_tokens=4)
    pc.evict_resident()
    blocks = pc.blocks
    original = type(blocks).fetch_block
    fetched = []

    def failing(self, *args, **kwargs):
        fetched.append(args[1])
        if len(fetched) == 2:
            raise OSError("the store lost a block")
        return original(self, *args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(type(blocks), "fetch_block", failing)
        with pytest.raises(OSError, match="lost a block"):
            pc.generate(PROMPTS["nested"], max_new_tokens=4)
    arena = pc.scheduler.arena
    assert arena.blocks == {} and arena.referenced_rows() == 0
    got = pc.generate(PROMPTS["nested"], max_new_tokens=4)
    assert got.token_ids == want.token_ids and torch.equal(got.first_logits, want.first_logits)
    pc.close()
