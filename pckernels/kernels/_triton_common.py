"""Triton pieces shared by the kernel modules: the gather launches' preamble (meta table, table,
alignment check, grid), host staging, and ``@triton.jit`` helpers. Imported only with a Triton
path, like the kernels themselves.

A gather launch reads one int64 *meta table* ``[1 + n_blocks, 6]``: row 0 describes ``out``, row
``1 + b`` block ``b``, each as ``(address, stride_l, stride_kv, stride_h, stride_n, stride_d)``
(element strides; those of size-1 dims 0). A host table is appended to it, so one copy (from
pinned memory, ``non_blocking``, on CUDA) moves both; nothing is cached between launches.
"""

from __future__ import annotations

import array
import functools

import torch
import triton
import triton.language as tl

from pckernels.kernels._align import ALIGN_BYTES, kernel_strides, rows_aligned
from pckernels.kernels._common import INTERPRET, to_device
from pckernels.kernels.gather_concat import check_table_host

try:
    from triton.language.extra import libdevice
except ImportError:
    libdevice = None

PRECISE_TRIG = libdevice is not None and not INTERPRET
"""Accurate ``libdevice`` sin/cos when compiled (the interpreter has none: it uses numpy's)."""

META_W = 6
RUN_BYTES = 16384
"""Bytes one program of an aligned gather copies (a flat piece of one run)."""


def stage(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``; on CUDA staged in pinned host memory and copied
    ``non_blocking`` (the caching host allocator keeps the page until the copy has run)."""
    return to_device(torch.frombuffer(array.array("q", values), dtype=torch.int64), device)


@functools.lru_cache(maxsize=1024)
def plane_layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], bool]:
    """``(kernel strides, fits)`` of a ``[L, 2, H, n, D]`` layout: the strides a gather kernel is
    given and whether, its address aside, it fits the aligned variant (flat rows). A memo of
    :func:`~pckernels.kernels._align.rows_aligned`: a few layouts recur in every launch."""
    return kernel_strides(shape, strides), rows_aligned((0, itemsize, shape, strides), flat_rows=True)


def launch_tables(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor, max_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int, int, bool] | None:
    """What a gather launch reads: ``(meta, table, table_at, entries, max_rows, aligned)``, or None
    when there is nothing to copy. ``meta`` is the meta table on ``out``'s device; the kernel
    finds entry ``m`` at ``table + table_at + m * width``; ``aligned`` says whether ``out`` and
    every block fit the aligned variant (:func:`pckernels.kernels._align.rows_aligned` with flat
    rows). A host table is bounds-checked (its first four columns), gives the row bound when
    ``max_rows`` is ``-1`` and travels behind the meta table in one staged copy (``table`` is then
    ``meta`` itself); a device table is not checked (no sync) and the bound falls back to ``cap``."""
    entries = table.shape[0]
    if not blocks or entries == 0:
        return None
    itemsize = out.element_size()
    values: list[int] = []
    aligned = True
    for t in (out, *blocks):
        address = t.data_ptr()
        strides, fits = plane_layout(t.shape, t.stride(), itemsize)
        aligned = aligned and fits and address % ALIGN_BYTES == 0
        values.append(address)
        values.extend(strides)
    if table.device.type == "cpu":
        rows = table.tolist()
        longest = check_table_host(rows, blocks, out.shape[3])
        max_rows = longest if max_rows < 0 else max_rows
        if max_rows == 0:
            return None
        table_at = len(values)
        for e in rows:
            values.extend(e)
        meta = stage(values, out.device)
        return meta, meta, table_at, entries, max_rows, aligned
    if max_rows < 0:
        max_rows = out.shape[3]
    if max_rows == 0:
        return None
    return stage(values, out.device), table.contiguous(), 0, entries, max_rows, aligned


def check_grid(grid: tuple[int, int, int], what: str) -> tuple[int, int, int]:
    """``grid`` unchanged, or ``ValueError`` past CUDA's limits on its 2nd and 3rd dims."""
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"{what} grid {grid} exceeds CUDA limits (table entries or L*2*H > 65535)")
    return grid


@triton.jit
def plane_index(plane, H: tl.constexpr):
    """``(l, kv, h)`` of program plane ``plane`` of a launch over ``[L, 2, H, ...]`` (int64)."""
    plane = plane.to(tl.int64)
    return plane // (2 * H), (plane // H) % 2, plane % H


@triton.jit
def run_start(like_ptr, desc, l, kv, h, row, D: tl.constexpr, VEC: tl.constexpr):
    """Aligned layout: pointer (``like_ptr``'s type) to row ``row`` of plane ``(l, kv, h)`` of the
    tensor described at ``desc`` (a meta-table row), whose rows are ``D`` contiguous elements and
    whose address and plane strides are multiples of 16 bytes (``VEC`` elements)."""
    base = tl.multiple_of(tl.load(desc).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)
    s_l = tl.multiple_of(tl.load(desc + 1), VEC)
    s_kv = tl.multiple_of(tl.load(desc + 2), VEC)
    s_h = tl.multiple_of(tl.load(desc + 3), VEC)
    return base + (l * s_l + kv * s_kv + h * s_h + row * D)


@triton.jit
def out_run_offset(desc, l, kv, h, row, D: tl.constexpr, VEC: tl.constexpr):
    """:func:`run_start` for ``out`` itself, as an element offset from its (16-byte aligned) address,
    the kernel argument."""
    s_l = tl.multiple_of(tl.load(desc + 1), VEC)
    s_kv = tl.multiple_of(tl.load(desc + 2), VEC)
    s_h = tl.multiple_of(tl.load(desc + 3), VEC)
    return l * s_l + kv * s_kv + h * s_h + row * D


@triton.jit
def strided_rows(like_ptr, desc, l, kv, h, rows):
    """Generic layout: pointers ``[BLOCK_R, 1]`` (``like_ptr``'s type) to ``rows`` of plane
    ``(l, kv, h)`` of the tensor described at ``desc``, and its stride over ``d``."""
    base = tl.load(desc).to(tl.pointer_type(like_ptr.dtype.element_ty))
    ptrs = base + l * tl.load(desc + 1) + kv * tl.load(desc + 2) + h * tl.load(desc + 3) \
        + rows[:, None] * tl.load(desc + 4)
    return ptrs, tl.load(desc + 5)


@triton.jit
def out_strided_rows(desc, l, kv, h, rows):
    """:func:`strided_rows` for ``out``: element offsets ``[BLOCK_R, 1]`` from its address, and its
    stride over ``d``."""
    offs = l * tl.load(desc + 1) + kv * tl.load(desc + 2) + h * tl.load(desc + 3) + rows[:, None] * tl.load(desc + 4)
    return offs, tl.load(desc + 5)


@triton.jit
def store_rounded(ptr, val, mask, ROUND_BF16: tl.constexpr):
    """Store fp32 ``val``; with ROUND_BF16, ``ptr`` is an int16 view of bf16 and rounding is done by hand (RTNE)."""
    if ROUND_BF16:
        bits = val.to(tl.uint32, bitcast=True)
        rnd = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rnd = tl.where(val != val, 0x7FC0, rnd)
        tl.store(ptr, rnd.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, val.to(ptr.dtype.element_ty), mask=mask)
