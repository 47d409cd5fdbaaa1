"""Host-side layout checks that pick a Triton kernel's *aligned* variant (pure functions, no Triton).

The aligned variants are compiled knowing that the innermost stride is 1, that a row is a whole
number of 16-byte vectors and that base addresses and outer strides are multiples of 16 bytes
(``tl.multiple_of``); they then load and store with 16-byte vectors. A false hint is undefined
behaviour on a GPU (and invisible to the interpreter, which ignores hints), so every launch checks
the tensors it was given with these functions and uses the aligned variant only when all of them
pass; otherwise the generic variant (run-time strides, any layout) runs.

A *layout* is ``(address, itemsize, shape, strides)``: ``address`` in bytes, strides in elements.
The strides of dims of size 1 (or 0) never count: those dims are only ever indexed at 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN_BYTES = 16
"""Width of one vector access (``ld.global.v4.b32``)."""

Layout = tuple[int, int, Sequence[int], Sequence[int]]


def layout_of(t: torch.Tensor) -> Layout:
    """``(address, itemsize, shape, strides)`` of ``t``."""
    return t.data_ptr(), t.element_size(), tuple(t.shape), t.stride()


def rows_aligned(layout: Layout, *, flat_rows: bool) -> bool:
    """Whether a tensor ``[..., n, D]`` fits the aligned kernels.

    Always: innermost stride 1, ``D * itemsize`` a multiple of 16 bytes, base address and the
    strides of every dim before ``n`` multiples of 16 bytes. With ``flat_rows`` the row stride must
    also be ``D`` (rows follow each other, so any run of rows of a plane is one flat run of
    ``n * D`` elements); without it the row stride need only be a multiple of 16 bytes.
    """
    address, itemsize, shape, strides = layout
    if len(shape) < 2 or len(strides) != len(shape):
        raise ValueError(f"rows_aligned needs a [..., n, D] layout, got shape {tuple(shape)} strides {tuple(strides)}")
    n, d = shape[-2], shape[-1]
    s_n, s_d = strides[-2], strides[-1]
    if address % ALIGN_BYTES or (d * itemsize) % ALIGN_BYTES:
        return False
    if d > 1 and s_d != 1:
        return False
    if n > 1 and (s_n != d if flat_rows else (s_n * itemsize) % ALIGN_BYTES):
        return False
    return all(size <= 1 or (s * itemsize) % ALIGN_BYTES == 0 for size, s in zip(shape[:-2], strides[:-2]))


def all_rows_aligned(layouts: Sequence[Layout], *, flat_rows: bool) -> bool:
    """:func:`rows_aligned` for every layout of one launch (the aligned variant needs them all)."""
    return all(rows_aligned(x, flat_rows=flat_rows) for x in layouts)


def kernel_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """``strides`` with those of dims of size <= 1 set to 0: what a kernel is given (it never
    indexes such a dim past 0, and 0 is a multiple of every alignment the aligned variant assumes)."""
    return tuple(s if size > 1 else 0 for size, s in zip(shape, strides))
