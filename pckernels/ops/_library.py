"""``torch.ops.promptcache.*`` of the product path, registered with ``torch.library.custom_op``
when this module is imported (``import pckernels`` does: a few milliseconds, no Triton).

Each op body branches on the device (and ``backend``) between the Triton launcher (its kernel
module, and Triton, imported on first use) and the torch-native path, so the same op runs on
CPU, CUDA, under ``opcheck`` and ``torch.compile``. The ops are opaque to Inductor:
``gather_concat`` and ``gather_rotate`` must be (their kernels read tables of raw addresses,
which FakeTensor tracing cannot provide), and ``torch.library.triton_op``, which would show
``scatter_rows``' kernel to Inductor, imports Triton and ``torch._inductor`` (about 2 s) when
it decorates. The ``*_impl`` functions are what the ops run; the Python API calls them directly
in eager mode (see :mod:`pckernels.ops`), with ``backend=None`` meaning
``$PROMPTCACHE_KERNEL_BACKEND``; the choice of path is memoised per device type and backend
(:func:`pckernels.kernels._common.triton_for`).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from pckernels.kernels import gather_concat as _g
from pckernels.kernels import gather_rotate as _gr
from pckernels.kernels import row_attention as _ra
from pckernels.kernels import scatter_rows as _s
from pckernels.kernels._common import triton_for

Tensor = torch.Tensor


def gather_concat_impl(out: Tensor, blocks: list[Tensor], table: Tensor, max_rows: int = -1,
                       backend: str | None = "auto") -> None:
    """``out [L, 2, H, cap, D]`` <- rows of ``blocks[b] [L, 2, H, n_b, D]`` per ``table [M, 4]`` entry."""
    _g.check_gather_args(out, blocks, table)
    if triton_for(out.device, backend):
        _g.gather_concat_triton(out, blocks, table, max_rows)
    else:
        _g.gather_concat_torch(out, blocks, table)


def gather_rotate_impl(out: Tensor, blocks: list[Tensor], table: Tensor, inv_freq: Tensor, max_rows: int = -1,
                       backend: str | None = "auto") -> None:
    """``out [L, 2, H, cap, D]`` <- rows of ``blocks[b]`` per ``table [M, 5]`` entry ``(b, src, dst, n,
    delta)``, keys re-rotated by ``delta`` with layer ``l``'s ``inv_freq [L, half]``."""
    _gr.check_gather_rotate_args(out, blocks, table, inv_freq)
    if triton_for(out.device, backend):
        _gr.gather_rotate_triton(out, blocks, table, inv_freq, max_rows)
    else:
        _gr.gather_rotate_torch(out, blocks, table, inv_freq)


def scatter_rows_impl(k_out: Tensor, v_out: Tensor, k: Tensor, v: Tensor, rows: Tensor,
                      backend: str | None = "auto") -> None:
    """``k_out[:, :, rows[i]] = k[:, :, i]`` and the same for v; ``[B, H, cap|q, D]``, ``rows [q]``."""
    _s.check_scatter_args(k_out, v_out, k, v, rows)
    if triton_for(k_out.device, backend):
        _s.scatter_rows_triton(k_out, v_out, k, v, rows)
    else:
        _s.scatter_rows_torch(k_out, v_out, k, v, rows)


def row_attention_impl(q: Tensor, k: Tensor, v: Tensor, seen: Tensor, group: Tensor, query_pos: Tensor,
                       key_pos: Tensor, start: Tensor, stop: Tensor, scale: float, window: int = -1, splits: int = -1,
                       backend: str | None = "auto") -> Tensor:
    """``q [Hq, n, D]`` over ``k, v [Hkv, kv, D]`` under the row mask (``window`` -1: none) -> ``[n, Hq, D]``;
    the Triton kernel where it fits (:func:`pckernels.kernels.row_attention.triton_fits`), else torch."""
    _ra.check_row_attention_args(q, k, v, seen, group, query_pos, key_pos, start, stop)
    win = None if window < 0 else window
    if triton_for(q.device, backend) and _ra.triton_fits(q, k):
        return _ra.row_attention_triton(q, k, v, seen, group, query_pos, key_pos, start, stop, scale, win, splits)
    return _ra.row_attention_torch(q, k, v, seen, group, query_pos, key_pos, start, stop, scale, win)


@custom_op("promptcache::gather_concat", mutates_args={"out"})
def gather_concat_op(out: Tensor, blocks: list[Tensor], table: Tensor, max_rows: int = -1,
                     backend: str = "auto") -> None:
    """Registered :func:`gather_concat_impl`."""
    gather_concat_impl(out, blocks, table, max_rows, backend)


@gather_concat_op.register_fake
def _gather_concat_fake(out, blocks, table, max_rows=-1, backend="auto") -> None:
    return None


@custom_op("promptcache::gather_rotate", mutates_args={"out"})
def gather_rotate_op(out: Tensor, blocks: list[Tensor], table: Tensor, inv_freq: Tensor, max_rows: int = -1,
                     backend: str = "auto") -> None:
    """Registered :func:`gather_rotate_impl`."""
    gather_rotate_impl(out, blocks, table, inv_freq, max_rows, backend)


@gather_rotate_op.register_fake
def _gather_rotate_fake(out, blocks, table, inv_freq, max_rows=-1, backend="auto") -> None:
    return None


@custom_op("promptcache::scatter_rows", mutates_args={"k_out", "v_out"})
def scatter_rows_op(k_out: Tensor, v_out: Tensor, k: Tensor, v: Tensor, rows: Tensor,
                    backend: str = "auto") -> None:
    """Registered :func:`scatter_rows_impl`."""
    scatter_rows_impl(k_out, v_out, k, v, rows, backend)


@scatter_rows_op.register_fake
def _scatter_rows_fake(k_out, v_out, k, v, rows, backend="auto") -> None:
    _s.check_scatter_args(k_out, v_out, k, v, rows)


@custom_op("promptcache::row_attention", mutates_args=())
def row_attention_op(q: Tensor, k: Tensor, v: Tensor, seen: Tensor, group: Tensor, query_pos: Tensor,
                     key_pos: Tensor, start: Tensor, stop: Tensor, scale: float, window: int = -1, splits: int = -1,
                     backend: str = "auto") -> Tensor:
    """Registered :func:`row_attention_impl`."""
    return row_attention_impl(q, k, v, seen, group, query_pos, key_pos, start, stop, scale, window, splits, backend)


@row_attention_op.register_fake
def _row_attention_fake(q, k, v, seen, group, query_pos, key_pos, start, stop, scale, window=-1, splits=-1,
                        backend="auto"):
    _ra.check_row_attention_args(q, k, v, seen, group, query_pos, key_pos, start, stop)
    return q.new_empty((q.shape[1], q.shape[0], q.shape[2]))


def onednn_linear_usable(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`linear_impl` hands ``x @ weight.T`` to oneDNN: fp32 CPU tensors of a
    build with oneDNN, a contiguous 2D weight and no autograd graph to record. A strided weight
    (the HF modules' weights are views of ``[in, out]`` tensors on the native forward's
    ``transposed`` CPU path) goes to ``F.linear``: oneDNN took minutes for a 600-token prompt
    through those modules on the AVX2 host, BLAS 1.7 s."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.is_contiguous() and x.dim() >= 1 and torch.backends.mkldnn.is_available()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear_impl(x: Tensor, weight: Tensor, bias: Tensor | None = None, backend: str = "auto") -> Tensor:
    """``x [..., in] @ weight[out, in].T (+ bias [out])`` -> ``[..., out]``.

    On CPU in fp32 ``"auto"`` runs oneDNN's inner product (``mkldnn._linear_pointwise``): for
    the few rows of a decode step it is 1.5-1.7x faster than the BLAS ``addmm`` behind
    ``F.linear`` on this project's models; ``"torch"`` (and anything else) is ``F.linear``.
    Both are fp32 GEMMs that agree to rounding (the reduction order differs)."""
    if backend == "auto" and onednn_linear_usable(x, weight) and (bias is None or bias.dtype == torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


@custom_op("promptcache::linear", mutates_args=())
def linear_op(x: Tensor, weight: Tensor, bias: Tensor | None = None, backend: str = "auto") -> Tensor:
    """Registered :func:`linear_impl`."""
    return linear_impl(x, weight, bias, backend)


@linear_op.register_fake
def _linear_fake(x, weight, bias=None, backend="auto"):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
