"""The kernels' aligned and generic variants (issue 41): the host-side alignment check itself,
every kernel on aligned, misaligned (2 or 4 bytes off), strided, odd-sized and size-1 tensors in
the Triton interpreter against the references (NaN-poisoned outputs), which variant each launch
took, one launch per gather whatever the number of blocks, and the offline PTX of the aligned
gathers (16-byte vector loads, no 2-byte scalar loads).

The interpreter ignores ``tl.multiple_of``: a wrong hint would only fail on a GPU, which is why the
predicate that decides the hints is tested directly here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pckernels import ops
from pckernels.kernels import HAS_TRITON, triton_runnable
from pckernels.kernels._align import all_rows_aligned, kernel_strides, layout_of, rows_aligned
from pckernels.kernels.gather_concat.naive import gather_concat_ref
from pckernels.kernels.gather_rotate.naive import gather_rotate_ref
from pckernels.kernels.scatter_rows.naive import scatter_rows_ref

from test_ops import assert_bits_equal, inv_freq_for

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS_TRITON = HAS_TRITON and triton_runnable(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(not RUNS_TRITON,
                                  reason="Triton cannot run here (no CUDA and TRITON_INTERPRET unset at import)")
DTYPES = [torch.float32, torch.bfloat16]
ROTATE_TOL = {torch.float32: 3e-6, torch.bfloat16: 1.6e-2}


# ----------------------------------------------------------------------------- the predicate

def test_rows_aligned_layouts():
    """Pure layouts ``(address, itemsize, shape, strides)``: every rule, one at a time."""
    shape, strides = (2, 2, 3, 5, 8), (240, 120, 40, 8, 1)
    assert rows_aligned((4096, 2, shape, strides), flat_rows=True)
    assert not rows_aligned((4098, 2, shape, strides), flat_rows=True)                  # 2 bytes off
    assert not rows_aligned((4096, 2, (2, 2, 3, 5, 6), (180, 90, 30, 6, 1)), flat_rows=True)  # rows of 12 B
    assert not rows_aligned((4096, 2, shape, (240, 120, 40, 8, 2)), flat_rows=True)     # d not contiguous
    assert not rows_aligned((4096, 2, shape, (240, 120, 8, 24, 1)), flat_rows=True)     # rows not flat
    assert rows_aligned((4096, 2, shape, (240, 120, 8, 24, 1)), flat_rows=False)        # ... fine for scatter
    assert not rows_aligned((4096, 2, shape, (240, 120, 8, 12, 1)), flat_rows=False)    # rows 24 B apart
    assert not rows_aligned((4096, 2, shape, (244, 120, 40, 8, 1)), flat_rows=True)     # layer stride 488 B
    assert rows_aligned((4096, 4, (1, 2, 1, 1, 4), (7, 4, 3, 9, 1)), flat_rows=True)    # size-1 dims: any stride
    assert not rows_aligned((4096, 4, (1, 2, 1, 1, 4), (7, 5, 3, 9, 1)), flat_rows=True)  # K/V 20 B apart
    assert not rows_aligned((4096, 4, (2, 2, 1, 1, 4), (7, 4, 3, 9, 1)), flat_rows=True)  # L=2: 28 B
    assert rows_aligned((0, 2, (1, 2, 1, 0, 8), (0, 0, 0, 8, 1)), flat_rows=True)       # no rows at all
    with pytest.raises(ValueError):
        rows_aligned((0, 2, (8,), (1,)), flat_rows=True)


def test_rows_aligned_tensors():
    """The same rules read from real tensors: fresh, 2 bytes off, transposed, row slices, size 1."""
    fresh = torch.zeros(2, 2, 3, 7, 8, dtype=torch.bfloat16)
    assert rows_aligned(layout_of(fresh), flat_rows=True)
    off = torch.zeros(fresh.numel() + 1, dtype=torch.bfloat16)[1:].view(fresh.shape)
    assert off.data_ptr() % 16 == 2 and not rows_aligned(layout_of(off), flat_rows=True)
    transposed = torch.zeros(2, 2, 7, 3, 8, dtype=torch.bfloat16).transpose(2, 3)
    assert not rows_aligned(layout_of(transposed), flat_rows=True)
    assert rows_aligned(layout_of(transposed), flat_rows=False)
    row_slice = torch.zeros(2, 2, 3, 11, 8, dtype=torch.bfloat16)[:, :, :, 2:9]     # rows 2..8: 32 B in
    assert not row_slice.is_contiguous() and rows_aligned(layout_of(row_slice), flat_rows=True)
    odd_slice = torch.zeros(2, 2, 3, 11, 8, dtype=torch.bfloat16)[:, :, 1:, 2:9]    # heads of 11 rows: 176 B
    assert rows_aligned(layout_of(odd_slice), flat_rows=True)
    assert not rows_aligned(layout_of(torch.zeros(2, 2, 3, 11, 9, dtype=torch.bfloat16)[..., :8]), flat_rows=True)
    one = torch.zeros(1, 2, 1, 1, 4)                                                  # fp32, D=4: 16 B
    assert rows_aligned(layout_of(one), flat_rows=True)
    assert not rows_aligned(layout_of(torch.zeros(1, 2, 1, 1, 2)), flat_rows=True)   # 8 B rows
    assert kernel_strides(one.shape, one.stride()) == (0, 4, 0, 0, 1)


def test_all_rows_aligned_mixed():
    """A launch is aligned only if every tensor in it is: one bad block sends it to the generic variant."""
    good = [layout_of(torch.zeros(1, 2, 2, n, 8, dtype=torch.bfloat16)) for n in (1, 5, 16)]
    bad = layout_of(torch.zeros(1 * 2 * 2 * 5 * 8 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 2, 5, 8))
    assert all_rows_aligned(good, flat_rows=True)
    assert not all_rows_aligned(good + [bad], flat_rows=True)
    assert not all_rows_aligned([bad] + good, flat_rows=True)
    assert all_rows_aligned([], flat_rows=True)


# ----------------------------------------------------------------------------- tensors for the kernels

def shifted(shape, dtype, device=DEVICE):
    """A contiguous tensor whose address is one element (2 or 4 bytes) past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    flat = torch.randn(n + 1, dtype=torch.float32).to(device=device, dtype=dtype)
    t = flat[1:].view(shape)
    assert t.data_ptr() % 16 != 0
    return t


def block(kind: str, L, H, n, D, dtype):
    """One source block ``[L, 2, H, n, D]``: ``fresh``, ``shifted`` (misaligned), ``transposed``
    (heads and rows swapped in memory) or ``slice`` (rows 3.. of a longer block: strided, aligned
    when a row is a 16-byte multiple)."""
    if kind == "fresh":
        return torch.randn(L, 2, H, n, D).to(device=DEVICE, dtype=dtype)
    if kind == "shifted":
        return shifted((L, 2, H, n, D), dtype)
    if kind == "transposed":
        return torch.randn(L, 2, n, H, D).to(device=DEVICE, dtype=dtype).transpose(2, 3)
    if kind == "slice":
        return torch.randn(L, 2, H, n + 5, D).to(device=DEVICE, dtype=dtype)[:, :, :, 3:3 + n]
    raise ValueError(kind)


def poisoned(kind: str, L, H, cap, D, dtype):
    """``out [L, 2, H, cap, D]`` full of NaN: ``fresh``, ``shifted`` or ``slice`` (of a wider arena)."""
    if kind == "fresh":
        return torch.full((L, 2, H, cap, D), float("nan"), dtype=dtype, device=DEVICE)
    if kind == "shifted":
        return shifted((L, 2, H, cap, D), dtype).fill_(float("nan"))
    return torch.full((L, 2, H, cap + 4, D), float("nan"), dtype=dtype, device=DEVICE)[:, :, :, 4:]


class Variants:
    """Records the ``ALIGNED`` flag of each launch of a Triton kernel (wraps ``kernel[grid]``)."""

    def __init__(self, fn):
        self.fn = fn
        self.flags: list[bool] = []

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            self.flags.append(bool(kwargs["ALIGNED"]))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def gather_variants(monkeypatch):
    from pckernels.kernels.gather_concat import kernel

    spy = Variants(kernel._gather_concat_kernel)
    monkeypatch.setattr(kernel, "_gather_concat_kernel", spy)
    ops.reset_launch_counts()
    return spy


@pytest.fixture
def rotate_variants(monkeypatch):
    from pckernels.kernels.gather_rotate import kernel

    spy = Variants(kernel._gather_rotate_kernel)
    monkeypatch.setattr(kernel, "_gather_rotate_kernel", spy)
    ops.reset_launch_counts()
    return spy


# (name, L, H, D, [(block kind, n)], out kind, table rows, aligned when bf16, aligned when fp32)
GATHER_LAYOUTS = [
    ("aligned", 2, 3, 8, [("fresh", 7), ("fresh", 33)], "fresh",
     [(1, 5, 0, 20), (0, 0, 20, 7), (1, 32, 30, 1)], True, True),
    ("odd-D-aligned", 3, 1, 24, [("fresh", 5), ("slice", 9)], "slice",
     [(1, 0, 0, 9), (0, 1, 11, 4)], True, True),
    ("block-2B-off", 1, 2, 8, [("fresh", 4), ("shifted", 6)], "fresh",
     [(0, 0, 0, 4), (1, 1, 4, 5)], False, False),
    ("out-off", 2, 1, 16, [("fresh", 3)], "shifted", [(0, 0, 2, 3)], False, False),
    ("transposed", 2, 3, 8, [("transposed", 6), ("fresh", 5)], "fresh",
     [(0, 0, 0, 6), (1, 2, 6, 3)], False, False),
    ("odd-rows-12B", 1, 1, 6, [("fresh", 5), ("fresh", 1)], "fresh",
     [(0, 0, 0, 5), (1, 0, 5, 1)], False, False),
    ("size-1", 1, 1, 8, [("fresh", 1)], "fresh", [(0, 0, 0, 1)], True, True),
    ("size-1-16B-fp32", 1, 1, 4, [("fresh", 1)], "fresh", [(0, 0, 0, 1)], False, True),
    ("many-blocks", 1, 2, 8, [("fresh", k) for k in (1, 2, 3, 4, 5, 6, 7, 8, 9)], "fresh",
     [(k, 0, k * (k + 1) // 2, k + 1) for k in range(9)], True, True),
]


def expected_aligned(case, dtype) -> bool:
    return case[7] if dtype == torch.bfloat16 else case[8]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GATHER_LAYOUTS, ids=lambda c: c[0])
def test_gather_concat_variants(dtype, case, gather_variants):
    """NaN-poisoned ``out`` vs the reference, bit for bit; the variant is the one the layout allows;
    one launch for the whole table, however many blocks."""
    name, L, H, D, kinds, out_kind, rows, _, _ = case
    blocks = [block(kind, L, H, n, D, dtype) for kind, n in kinds]
    cap = max(d + n for _, _, d, n in rows) + 3
    out = poisoned(out_kind, L, H, cap, D, dtype)
    expect = out.clone()
    table = torch.tensor(rows, dtype=torch.int64)
    gather_concat_ref(expect, blocks, table)
    ops.gather_concat(out, blocks, table, backend="triton")
    assert_bits_equal(out, expect)
    assert gather_variants.flags == [expected_aligned(case, dtype)]
    assert ops.launch_counts() == {"gather_concat": 1}
    written = torch.zeros(cap, dtype=torch.bool)
    for _, _, d, n in rows:
        written[d:d + n] = True
    assert not out[:, :, :, written.to(DEVICE)].isnan().any()
    assert out[:, :, :, (~written).to(DEVICE)].isnan().all()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_concat_device_table_variants(dtype, gather_variants):
    """A device-resident int32 table (not bounds-checked, ``max_rows`` given) takes the same variants."""
    blocks = [block("fresh", 2, 2, 5, 8, dtype), block("slice", 2, 2, 4, 8, dtype)]
    table = torch.tensor([[1, 0, 0, 4], [0, 1, 4, 4]], dtype=torch.int32, device=DEVICE)
    for out_kind, want in (("fresh", True), ("shifted", False)):
        out = poisoned(out_kind, 2, 2, 9, 8, dtype)
        expect = out.clone()
        gather_concat_ref(expect, blocks, table.cpu())
        ops.gather_concat(out, blocks, table, max_rows=4, backend="triton")
        assert_bits_equal(out, expect)
        assert gather_variants.flags[-1] is want
    assert ops.launch_counts() == {"gather_concat": 2}


# (name, L, H, D, half, [(block kind, n)], out kind, rows (b, src, dst, n, delta), aligned bf16, aligned fp32)
ROTATE_LAYOUTS = [
    ("aligned-full-rotary", 2, 3, 8, 4, [("fresh", 7), ("fresh", 33)], "fresh",
     [(1, 5, 0, 20, 300), (0, 0, 20, 7, -41), (1, 32, 30, 1, 0)], True, True),
    ("aligned-partial-odd-half", 3, 2, 24, 3, [("slice", 9), ("fresh", 4)], "slice",
     [(0, 0, 0, 9, 1000), (1, 1, 12, 3, -7)], True, True),
    ("no-rotary-dims", 2, 1, 8, 0, [("fresh", 5)], "fresh", [(0, 0, 1, 5, 99)], True, True),
    ("block-2B-off", 2, 2, 8, 2, [("shifted", 6), ("fresh", 3)], "fresh",
     [(0, 0, 0, 6, 17), (1, 0, 6, 3, -5)], False, False),
    ("transposed", 1, 3, 12, 5, [("transposed", 5)], "fresh", [(0, 0, 2, 5, 123)], False, False),
    ("out-off", 1, 1, 16, 8, [("fresh", 4)], "shifted", [(0, 0, 0, 4, 64)], False, False),
    ("odd-rows-12B", 2, 1, 6, 3, [("fresh", 7)], "fresh", [(0, 2, 0, 5, 2000)], False, False),
    ("size-1", 1, 1, 8, 4, [("fresh", 1)], "fresh", [(0, 0, 0, 1, 5)], True, True),
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROTATE_LAYOUTS, ids=lambda c: c[0])
def test_gather_rotate_variants(dtype, case, rotate_variants):
    """Against :func:`gather_rotate_ref`: values and non-rotary key dims bit-exact, rotated dims
    within tolerance (the interpreter computes bf16 in fp32), a zero ``inv_freq`` row and
    ``delta = 0`` bit-exact, unwritten rows NaN; the variant the layout allows; one launch."""
    name, L, H, D, half, kinds, out_kind, rows, want_bf16, want_fp32 = case
    blocks = [block(kind, L, H, n, D, dtype) for kind, n in kinds]
    cap = max(d + n for _, _, d, n, _ in rows) + 3
    out = poisoned(out_kind, L, H, cap, D, dtype)
    inv = torch.stack([inv_freq_for(2 * half, 10000.0 * (1 + layer)) for layer in range(L)]).reshape(L, half)
    if L > 1:
        inv[L - 1] = 0
    table = torch.tensor(rows, dtype=torch.int64)
    expect = out.cpu().clone()
    gather_rotate_ref(expect, [b.cpu() for b in blocks], table, inv)
    ops.gather_rotate(out, blocks, table, inv.to(DEVICE), backend="triton")
    got = out.cpu()
    assert rotate_variants.flags == [want_bf16 if dtype == torch.bfloat16 else want_fp32]
    assert ops.launch_counts() == {"gather_rotate": 1}
    assert_bits_equal(got[:, 1], expect[:, 1])
    assert_bits_equal(got[:, 0, :, :, 2 * half:], expect[:, 0, :, :, 2 * half:])
    rotary = (got[:, 0, :, :, :2 * half].float() - expect[:, 0, :, :, :2 * half].float()).nan_to_num(0.0)
    assert rotary.numel() == 0 or rotary.abs().max().item() <= ROTATE_TOL[dtype]
    assert torch.equal(got.isnan(), expect.isnan())
    if L > 1:
        assert_bits_equal(got[L - 1], expect[L - 1])
    for b, src, dst, n, delta in rows:
        if delta == 0 and n:
            assert_bits_equal(got[:, :, :, dst:dst + n], blocks[b][:, :, :, src:src + n].cpu())
    written = torch.zeros(cap, dtype=torch.bool)
    for _, _, d, n, _ in rows:
        written[d:d + n] = True
    assert not got[:, :, :, written].isnan().any() and got[:, :, :, ~written].isnan().all()


# (name, B, H, cap, D, rows, k layout, out layout, aligned bf16, aligned fp32)
SCATTER_LAYOUTS = [
    ("aligned", 1, 3, 40, 8, [39, 0, 17, 5, 6, 7, 30], "fresh", "fresh", True, True),
    ("qkv-rows", 1, 2, 9, 8, [8, 1, 4], "qkv", "fresh", True, True),
    ("odd-D-aligned", 2, 1, 11, 24, [10, 0, 3], "fresh", "fresh", True, True),
    ("k-2B-off", 1, 2, 12, 8, [11, 3, 0], "shifted", "fresh", False, False),
    ("out-off", 1, 1, 7, 16, [6, 2], "fresh", "shifted", False, False),
    ("d-strided", 1, 2, 6, 8, [5, 1], "d-strided", "fresh", False, False),
    ("rows-12B", 1, 3, 9, 6, [8, 0, 4, 2], "fresh", "fresh", False, False),
    ("size-1", 1, 1, 1, 8, [0], "fresh", "fresh", True, True),
]


def scatter_inputs(kind, B, H, q, D, dtype):
    if kind == "fresh":
        return [torch.randn(B, H, q, D).to(device=DEVICE, dtype=dtype) for _ in range(2)]
    if kind == "qkv":  # keys and values inside one projection row, as a native forward lays them out
        qkv = torch.randn(q, 3, H, D).to(device=DEVICE, dtype=dtype)
        kv = qkv[:, 1:].permute(1, 2, 0, 3)
        return [kv[0:1], kv[1:2]]
    if kind == "shifted":
        return [shifted((B, H, q, D), dtype) for _ in range(2)]
    return [torch.randn(B, H, q, 2 * D).to(device=DEVICE, dtype=dtype)[..., ::2] for _ in range(2)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SCATTER_LAYOUTS, ids=lambda c: c[0])
def test_scatter_rows_variants(dtype, case, monkeypatch):
    """Against :func:`scatter_rows_ref`, bit for bit, NaN-poisoned buffers; the variant the layout allows."""
    from pckernels.kernels.scatter_rows import kernel

    ran = []
    for name in ("_scatter_rows_aligned", "_scatter_rows_generic"):
        fn = getattr(kernel, name)

        class Spy:
            def __getitem__(self, grid, fn=fn, name=name):
                ran.append(name)
                return fn[grid]

        monkeypatch.setattr(kernel, name, Spy())
    _, B, H, cap, D, rows, k_kind, out_kind, want_bf16, want_fp32 = case
    q = len(rows)
    k, v = scatter_inputs(k_kind, B, H, q, D, dtype)
    if out_kind == "fresh":
        buf = torch.full((2, B, H, cap, D), float("nan"), dtype=dtype, device=DEVICE)
    else:
        buf = shifted((2, B, H, cap, D), dtype).fill_(float("nan"))
    k_out, v_out = buf[0], buf[1]
    r = torch.tensor(rows, device=DEVICE)
    ek, ev = k_out.clone(), v_out.clone()
    scatter_rows_ref(ek, ev, k, v, r)
    ops.reset_launch_counts()
    ops.scatter_rows(k_out, v_out, k, v, r, backend="triton")
    assert_bits_equal(k_out, ek)
    assert_bits_equal(v_out, ev)
    want = want_bf16 if dtype == torch.bfloat16 else want_fp32
    assert ran == ["_scatter_rows_aligned" if want else "_scatter_rows_generic"]
    assert ops.launch_counts() == {"scatter_rows": 1}


@needs_triton
def test_write_rows_scatters_with_one_launch():
    """``write_rows`` (the engine's KV write) with rows: one scatter launch; without: none (a copy)."""
    class Buf:
        data = torch.full((2, 2, 3, 10, 8), float("nan"), device=DEVICE)

    k, v = torch.randn(1, 3, 2, 8, device=DEVICE), torch.randn(1, 3, 2, 8, device=DEVICE)
    ops.reset_launch_counts()
    ops.write_rows(Buf, 1, k, v, torch.tensor([7, 2], device=DEVICE), 0, backend="triton")
    ops.write_rows(Buf, 0, k, v, None, 4, backend="triton")
    assert ops.launch_counts() == {"scatter_rows": 1}
    assert torch.equal(Buf.data[1, 0, :, [7, 2]], k[0]) and torch.equal(Buf.data[1, 1, :, [7, 2]], v[0])
    assert torch.equal(Buf.data[0, 0, :, 4:6], k[0]) and torch.equal(Buf.data[0, 1, :, 4:6], v[0])
    assert Buf.data.isnan().sum() == Buf.data.numel() - 4 * 3 * 2 * 8


# ----------------------------------------------------------------------------- launch plumbing

@needs_triton
def test_launch_tables_one_staged_buffer():
    """A host table travels in the meta table's buffer: row 0 ``out``, then the blocks (strides of
    size-1 dims 0), then the entries; a device table is used as it is (no check, the bound is
    ``cap``); nothing is kept between launches."""
    from pckernels.kernels._triton_common import launch_tables

    out = torch.zeros(1, 2, 3, 9, 8, device=DEVICE)
    blocks = [torch.zeros(1, 2, 3, 4, 8, device=DEVICE), torch.zeros(1, 2, 3, 1, 8, device=DEVICE)]
    table = torch.tensor([[0, 0, 0, 4], [1, 0, 4, 1]], dtype=torch.int32)
    meta, same, table_at, entries, max_rows, aligned = launch_tables(out, blocks, table, -1)
    assert same is meta and aligned and max_rows == 4 and entries == 2 and table_at == 18
    assert meta.cpu().tolist() == [
        out.data_ptr(), 0, 216, 72, 8, 1,
        blocks[0].data_ptr(), 0, 96, 32, 8, 1,
        blocks[1].data_ptr(), 0, 24, 8, 0, 1,
        0, 0, 0, 4, 1, 0, 4, 1,
    ]
    if DEVICE == "cuda":  # on a CPU run every table is a host table
        device_table = table.to(DEVICE)
        meta, dev_table, table_at, entries, max_rows, aligned = launch_tables(out, blocks, device_table, -1)
        assert dev_table is device_table and table_at == 0 and entries == 2 and max_rows == 9
        assert meta.numel() == 18
    assert launch_tables(out, blocks, table[:0], -1) is None
    assert launch_tables(out, blocks, torch.tensor([[0, 0, 0, 0]]), -1) is None


def test_backend_choice_is_memoised(monkeypatch):
    """The ops decide their path once per (device type, backend, env): later calls read the memo;
    a changed environment is a new key; bad names raise every time."""
    from pckernels.kernels import _common

    calls = []
    original = _common.use_triton

    def counting(device, backend):
        calls.append(backend)
        return original(device, backend)

    monkeypatch.setattr(_common, "use_triton", counting)
    monkeypatch.setattr(_common, "_choices", {})
    monkeypatch.delenv(_common.BACKEND_ENV, raising=False)
    args = (torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2),
            torch.tensor([1]))
    for _ in range(3):
        ops.scatter_rows(*args, backend="torch")
        ops.scatter_rows(*args)
    assert calls == ["torch", "auto"]
    monkeypatch.setenv(_common.BACKEND_ENV, "torch")
    ops.scatter_rows(*args)
    assert calls == ["torch", "auto", "torch"]
    monkeypatch.setenv(_common.BACKEND_ENV, "gpu")
    for _ in range(2):
        with pytest.raises(ValueError, match="'gpu'"):
            ops.scatter_rows(*args)
    assert args[0][0, 0, 1].tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- offline PTX

def test_ptx_aligned_gathers_use_16_byte_vectors():
    """``python -m perf.kernels.ptx --json`` compiles the kernels for sm_90 without a GPU: the
    aligned gathers (and the aligned scatter) load and store with 16-byte vectors, have no 2-byte
    scalar loads and do not spill; the generic gather is still there, scalar."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "perf.kernels.ptx", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip(f"offline compilation unavailable: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for line in lines:  # "name: N registers, S bytes spilled" where the bundled ptxas ran
        name, _, usage = line.partition(": ")
        if name in ("gather_concat", "gather_rotate", "scatter_rows") and "bytes spilled" in usage:
            assert usage.endswith(" 0 bytes spilled"), line
    for name in ("gather_concat", "gather_rotate", "scatter_rows"):
        loads, stores = result[name]["loads"], result[name]["stores"]
        assert loads.get("ld.global.v4.b32", 0) >= 1, (name, loads)
        assert stores.get("st.global.v4.b32", 0) >= 1, (name, stores)
        assert not any(k.endswith((".b16", ".u16", ".s16")) for k in loads), (name, loads)
        assert not any(k.endswith((".b16", ".u16", ".s16")) for k in stores), (name, stores)
    for name in ("gather_concat", "gather_rotate"):
        assert result[name]["convert_layout"] is False
    # a decode step's one-row scatter: one warp, so that its threads still move vectors
    assert not any(k.endswith((".b16", ".u16", ".s16")) for k in result["scatter_rows_q1"]["loads"])
    assert result["gather_concat_generic"]["loads"].get("ld.global.b16", 0) > 0
    assert set(result) >= {"gather_concat_generic", "gather_rotate_generic", "scatter_rows_generic"}
