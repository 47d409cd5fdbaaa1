"""Assembly buffer bookkeeping: growth, residency of cached blocks, partial invalidation."""

import torch

from pckernels.engine.buffer import AssemblyBuffer, Placement
from pckernels.integration.attention import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)


def make(capacity=10):
    return AssemblyBuffer(LAYOUT, dtype=torch.float32, device="cpu", capacity=capacity)


def test_capacity_grows_only_and_rounds():
    buf = make(10)
    assert buf.capacity == 256 and buf.allocations == 1
    buf.ensure_capacity(100)
    assert buf.capacity == 256 and buf.allocations == 1
    buf.ensure_capacity(300)
    assert buf.capacity >= 384 and buf.allocations == 2


def test_resident_block_needs_no_copy():
    buf = make()
    p = Placement(("a",), 0, 5, 10)
    assert buf.missing(p) == [p]
    buf.mark_resident(p)
    assert buf.missing(p) == []
    assert buf.missing(Placement(("a",), 0, 6, 10)) == [Placement(("a",), 0, 6, 10)]
    assert buf.missing(Placement(("b",), 0, 5, 10)) == [Placement(("b",), 0, 5, 10)]


def test_overwriting_rows_keeps_the_rest_of_a_block():
    buf = make()
    p = Placement(("a",), 0, 5, 10)
    buf.mark_resident(p)
    buf.invalidate_rows(8, 10)
    assert buf.missing(p) == [Placement(("a",), 3, 8, 2)]
    buf.invalidate_rows(0, 6)
    assert buf.missing(p) == [Placement(("a",), 0, 5, 1), Placement(("a",), 3, 8, 2)]
    buf.mark_resident(p)
    assert buf.missing(p) == []


def test_placing_a_block_evicts_overlapping_ones():
    buf = make()
    buf.mark_resident(Placement(("a",), 0, 0, 10))
    buf.mark_resident(Placement(("b",), 0, 4, 3))
    assert buf.missing(Placement(("a",), 0, 0, 10)) == [Placement(("a",), 4, 4, 3)]
    assert buf.missing(Placement(("b",), 0, 4, 3)) == []


def test_growth_forgets_residency():
    buf = make()
    buf.mark_resident(Placement(("a",), 0, 0, 10))
    buf.ensure_capacity(1000)
    assert buf.missing(Placement(("a",), 0, 0, 10)) == [Placement(("a",), 0, 0, 10)]


def test_attention_is_causal_by_position_over_live_rows():
    buf = make()
    buf.row_pos[:4] = torch.tensor([0, 1, 7, 3])
    buf.row_bias[:4] = torch.tensor([0.0, float("-inf"), 0.0, 0.0])
    spec = buf.attention(torch.tensor([3, 8]), 4)
    visible = torch.isfinite(spec.bias)
    assert visible.tolist() == [[True, False, False, True], [True, False, True, True]]
