"""Python API over the promptcache kernels of the product path (the RoPE extras are in
:mod:`pckernels.extras`).

Every function takes ``backend=None | "auto" | "triton" | "torch"``: ``None`` reads
``$PROMPTCACHE_KERNEL_BACKEND`` (default ``"auto"``: Triton on CUDA, torch elsewhere);
``"triton"`` forces the kernel (on CPU only under ``TRITON_INTERPRET=1``). In eager mode
the functions call the implementations directly, skipping the dispatcher (a registered op
costs tens of microseconds per call, and ``scatter_rows`` runs once per layer per forward);
under ``torch.compile`` they go through ``torch.ops.promptcache.*`` (registered when this
package is imported, :mod:`._library`) so graphs stay traceable. Both run the same code.
"""

from __future__ import annotations

import torch

from pckernels.kernels._common import launch_counts, reset_launch_counts, resolve_backend
from pckernels.ops import _library as _lib

Tensor = torch.Tensor

__all__ = [
    "gather_concat",
    "gather_rotate",
    "launch_counts",
    "linear",
    "reset_launch_counts",
    "row_attention",
    "scatter_rows",
    "write_rows",
]


def _use_op() -> bool:
    return torch.compiler.is_compiling()


def gather_concat(out: Tensor, blocks: list[Tensor], table: Tensor, *, max_rows: int | None = None,
                  backend: str | None = None) -> None:
    """Copy row ranges of cached KV blocks into the assembly buffer, in place, one launch.

    ``out [L, 2, H, cap, D]``; ``blocks[b] [L, 2, H, n_b, D]`` (same dtype/device, any strides);
    ``table [M, 4]`` int32/int64 rows ``(block, src_row, dst_row, n_rows)``: for every layer,
    K and V and head, ``out[..., dst:dst+n, :] = blocks[block][..., src:src+n, :]``.
    A host table is bounds-checked and copied to the device; a device table is trusted and
    ``max_rows`` (largest ``n_rows``) should be given to size the grid.
    """
    mr = -1 if max_rows is None else int(max_rows)
    if _use_op():
        torch.ops.promptcache.gather_concat(out, list(blocks), table, mr, resolve_backend(backend))
    else:
        _lib.gather_concat_impl(out, blocks if isinstance(blocks, list) else list(blocks), table, mr, backend)


def gather_rotate(out: Tensor, blocks: list[Tensor], table: Tensor, inv_freq: Tensor, *,
                  max_rows: int | None = None, backend: str | None = None) -> None:
    """Gather-concat with re-rotation: copy row ranges of cached KV blocks into ``out`` and move
    their keys to new positions on the way, in place, one launch.

    ``out [L, 2, H, cap, D]``; ``blocks[b] [L, 2, H, n_b, D]``; ``table [M, 5]`` int32/int64 rows
    ``(block, src_row, dst_row, n_rows, delta)``: ``out[..., dst:dst+n, :] = blocks[block][...,
    src:src+n, :]`` with the keys of layer ``l`` then rotated by ``R(delta)`` over the first
    ``2 * half`` dims with ``inv_freq [L, half]`` (float32; rotate-half, no attention scaling: the
    keys already carry it). A zero ``inv_freq`` row (a layer without RoPE) or ``delta = 0`` copies
    bit-exactly, as do values and the keys' other dims. Table rules as in :func:`gather_concat`.
    """
    mr = -1 if max_rows is None else int(max_rows)
    if _use_op():
        torch.ops.promptcache.gather_rotate(out, list(blocks), table, inv_freq, mr, resolve_backend(backend))
    else:
        _lib.gather_rotate_impl(out, blocks if isinstance(blocks, list) else list(blocks), table, inv_freq, mr,
                                backend)


def scatter_rows(k_out: Tensor, v_out: Tensor, k: Tensor, v: Tensor, rows: Tensor, *,
                 backend: str | None = None) -> None:
    """``k_out[:, :, rows[i]] = k[:, :, i]`` (and v), in place, one launch.

    ``k_out, v_out [B, H, cap, D]``, ``k, v [B, H, q, D]``, ``rows [q]`` int32/int64.
    """
    if _use_op():
        torch.ops.promptcache.scatter_rows(k_out, v_out, k, v, rows, resolve_backend(backend))
    else:
        _lib.scatter_rows_impl(k_out, v_out, k, v, rows, backend)


def row_attention(q: Tensor, k: Tensor, v: Tensor, seen: Tensor, group: Tensor, query_pos: Tensor, key_pos: Tensor,
                  start: Tensor, stop: Tensor, *, scale: float, window: int | None = None, splits: int | None = None,
                  backend: str | None = None) -> Tensor:
    """Attention of a few queries over many KV rows with the mask given by rows -> ``[n, Hq, D]``.

    ``q [Hq, n, D]``, ``k, v [Hkv, kv, D]`` (grouped heads); query ``i`` sees row ``j`` when
    ``seen[group[i], j]`` (``seen [G, kv]`` bool, ``group [n]``), ``start[i] <= j < stop[i]``,
    ``key_pos[j] <= query_pos[i]`` and, with ``window``, ``query_pos[i] - key_pos[j] < window``.
    Unseen rows contribute nothing (NaN there included); a query that sees nothing gets zeros.
    Triton (split-KV, ``splits`` stretches per KV head, None: chosen for the device) on CUDA for up
    to 64 query rows per KV head, else the torch path.
    """
    win = -1 if window is None else int(window)
    sp = -1 if splits is None else int(splits)
    if _use_op():
        return torch.ops.promptcache.row_attention(q, k, v, seen, group, query_pos, key_pos, start, stop, float(scale),
                                                   win, sp, resolve_backend(backend))
    return _lib.row_attention_impl(q, k, v, seen, group, query_pos, key_pos, start, stop, float(scale), win, sp,
                                   backend)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, backend: str | None = None) -> Tensor:
    """``x [..., in] @ weight [out, in].T + bias [out]`` -> ``[..., out]``, as ``F.linear``.

    ``"auto"`` on CPU in fp32 runs oneDNN's inner product (faster than BLAS for the few rows
    of a decode step); ``"torch"``, other devices and dtypes, and autograd use ``F.linear``.
    """
    b = resolve_backend(backend)
    if _use_op():
        return torch.ops.promptcache.linear(x, weight, bias, b)
    return _lib.linear_impl(x, weight, bias, b)


def write_rows(buf, layer: int, key_states: Tensor, value_states: Tensor, rows: Tensor | None, start: int,
               *, backend: str | None = None) -> None:
    """Adapter with the engine's ``BufferCache.write_rows_fn`` signature.

    ``buf.data [L, 2, H, cap, D]``; ``key_states/value_states [1, H, q, D]`` go to ``rows [q]``
    or, when ``rows`` is None, to the contiguous rows ``start .. start + q`` (a plain copy).
    """
    q = key_states.shape[2]
    data = buf.data
    k_out = data[layer, 0:1]
    v_out = data[layer, 1:2]
    if rows is None:
        k_out[:, :, start:start + q].copy_(key_states)
        v_out[:, :, start:start + q].copy_(value_states)
    else:
        scatter_rows(k_out, v_out, key_states, value_states, rows, backend=backend)
