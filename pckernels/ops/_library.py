"""``torch.ops.promptcache.*``: the kernels registered with ``torch.library``.

Each op body branches on the device (and ``backend``) between the Triton launcher and the
torch-native path, so the same op runs on CPU, CUDA, under ``opcheck`` and ``torch.compile``.
``gather_concat`` is an opaque ``custom_op`` (its kernel reads a table of raw addresses,
which FakeTensor tracing cannot provide); the others are ``triton_op`` with ``wrap_triton``,
so Inductor sees their kernels. The ``*_impl`` functions are what the ops run; the
Python API calls them directly in eager mode (see :mod:`pckernels.ops`).
"""

from __future__ import annotations

import torch
from torch.library import custom_op, triton_op, wrap_triton

from pckernels.kernels import gather_concat as _g
from pckernels.kernels import rope as _r
from pckernels.kernels import slot_scatter as _s
from pckernels.kernels._common import use_triton

Tensor = torch.Tensor


def gather_concat_impl(out: Tensor, blocks: list[Tensor], table: Tensor, max_rows: int = -1,
                       backend: str = "auto") -> None:
    """``out [L, 2, H, cap, D]`` <- rows of ``blocks[b] [L, 2, H, n_b, D]`` per ``table [M, 4]`` entry."""
    _g.check_gather_args(out, blocks, table)
    if use_triton(out.device, backend):
        _g.gather_concat_triton(out, blocks, table, max_rows)
    else:
        _g.gather_concat_torch(out, blocks, table)


def gather_rotate_impl(out: Tensor, blocks: list[Tensor], table: Tensor, inv_freq: Tensor, max_rows: int = -1,
                       backend: str = "auto") -> None:
    """``out [L, 2, H, cap, D]`` <- rows of ``blocks[b]`` per ``table [M, 5]`` entry ``(b, src, dst, n,
    delta)``, keys re-rotated by ``delta`` with layer ``l``'s ``inv_freq [L, half]``."""
    _r.check_gather_rotate_args(out, blocks, table, inv_freq)
    if use_triton(out.device, backend):
        _r.gather_rotate_triton(out, blocks, table, inv_freq, max_rows)
    else:
        _r.gather_rotate_torch(out, blocks, table, inv_freq)


def scatter_rows_impl(k_out: Tensor, v_out: Tensor, k: Tensor, v: Tensor, rows: Tensor,
                      backend: str = "auto", launch=None) -> None:
    """``k_out[:, :, rows[i]] = k[:, :, i]`` and the same for v; ``[B, H, cap|q, D]``, ``rows [q]``."""
    _s.check_scatter_args(k_out, v_out, k, v, rows)
    if use_triton(k_out.device, backend):
        _s.scatter_rows_triton(k_out, v_out, k, v, rows, launch=launch)
    else:
        _s.scatter_rows_torch(k_out, v_out, k, v, rows)


def _check_positions(x: Tensor, inv_freq: Tensor) -> None:
    _r.check_rope_x(x, inv_freq.shape[0])
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be [R / 2], got {tuple(inv_freq.shape)}")


def rope_at_positions_impl(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scaling: float,
                           out: Tensor, backend: str = "auto", launch=None) -> None:
    """``out [B, H, S, D]`` <- ``x`` rotated at ``positions [S] | [B, S]`` (``out`` may be ``x``)."""
    _check_positions(x, inv_freq)
    if out is not x and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must match x: {tuple(x.shape)} {x.dtype} {x.device}")
    if use_triton(x.device, backend):
        _r.rope_positions_triton(x, positions, inv_freq, attention_scaling, out, launch=launch)
    else:
        _r.rope_positions_torch(x, positions, inv_freq, attention_scaling, out)


def _check_cos_sin(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    half = cos.shape[-1] // 2
    _r.check_rope_x(q, half, "q")
    _r.check_rope_x(k, half, "k")
    if cos.dim() != 3 or sin.shape != cos.shape or cos.shape[-1] % 2:
        raise ValueError(f"cos/sin must both be [B|1, S, R] with even R, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    B, _, S, _ = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != q.shape[3] or k.dtype != q.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} must share B, S, D and dtype with q {tuple(q.shape)} {q.dtype}")
    if cos.shape[0] not in (1, B) or cos.shape[1] != S:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not broadcast to B={B}, S={S}")


def apply_rotary_pos_emb_impl(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str = "auto",
                              launch=None) -> tuple[Tensor, Tensor]:
    """HF's ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``): ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]``,
    ``cos, sin [B|1, S, R]``, R <= D (the rest passes through). Returns new tensors."""
    _check_cos_sin(q, k, cos, sin)
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    if use_triton(q.device, backend):
        _r.rope_cos_sin_triton(q, k, cos, sin, q_out, k_out, launch=launch)
    else:
        _r.rope_cos_sin_torch(q, cos, sin, q_out)
        _r.rope_cos_sin_torch(k, cos, sin, k_out)
    return q_out, k_out


def rerotate_keys_impl(k: Tensor, delta: Tensor, inv_freq: Tensor, backend: str = "auto", launch=None) -> None:
    """In place, ``k [B, H, n, D]`` rotated at p -> at p + delta; ``delta`` is 0-d, ``[n]`` or ``[B, n]``."""
    pos = delta.reshape(1).expand(k.shape[2]) if delta.dim() == 0 else delta
    rope_at_positions_impl(k, pos, inv_freq, 1.0, k, backend, launch)


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
    """Registered :func:`gather_rotate_impl` (opaque like gather-concat: its kernel reads raw addresses)."""
    gather_rotate_impl(out, blocks, table, inv_freq, max_rows, backend)


@gather_rotate_op.register_fake
def _gather_rotate_fake(out, blocks, table, inv_freq, max_rows=-1, backend="auto") -> None:
    return None


@triton_op("promptcache::scatter_rows", mutates_args={"k_out", "v_out"})
def scatter_rows_op(k_out: Tensor, v_out: Tensor, k: Tensor, v: Tensor, rows: Tensor,
                    backend: str = "auto") -> None:
    """Registered :func:`scatter_rows_impl`."""
    scatter_rows_impl(k_out, v_out, k, v, rows, backend, launch=wrap_triton)


@triton_op("promptcache::rope_at_positions", mutates_args={"out"})
def rope_at_positions_op(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scaling: float,
                         out: Tensor, backend: str = "auto") -> None:
    """Registered :func:`rope_at_positions_impl` into a separate ``out``."""
    rope_at_positions_impl(x, positions, inv_freq, attention_scaling, out, backend, launch=wrap_triton)


@triton_op("promptcache::rope_at_positions_", mutates_args={"x"})
def rope_at_positions_inplace_op(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scaling: float,
                                 backend: str = "auto") -> None:
    """Registered :func:`rope_at_positions_impl`, in place on ``x``."""
    rope_at_positions_impl(x, positions, inv_freq, attention_scaling, x, backend, launch=wrap_triton)


@triton_op("promptcache::rerotate_keys_", mutates_args={"k"})
def rerotate_keys_op(k: Tensor, delta: Tensor, inv_freq: Tensor, backend: str = "auto") -> None:
    """Registered :func:`rerotate_keys_impl` (in place)."""
    rerotate_keys_impl(k, delta, inv_freq, backend, launch=wrap_triton)


@triton_op("promptcache::apply_rotary_pos_emb", mutates_args=())
def apply_rotary_pos_emb_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                            backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Registered :func:`apply_rotary_pos_emb_impl`."""
    return apply_rotary_pos_emb_impl(q, k, cos, sin, backend, launch=wrap_triton)


def _rope_setup_context(ctx, inputs, output) -> None:
    q, k, cos, sin, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(q if ctx.needs_input_grad[2] or ctx.needs_input_grad[3] else None,
                          k if ctx.needs_input_grad[2] or ctx.needs_input_grad[3] else None, cos, sin)


def _rope_backward(ctx, grad_q, grad_k):
    """The rotation is orthogonal per pair: dx = rope(g) with cos and ``-swap_halves(sin)``."""
    q, k, cos, sin = ctx.saved_tensors
    half = cos.shape[-1] // 2
    sin_t = -torch.cat((sin[..., half:], sin[..., :half]), dim=-1)
    dq, dk = torch.ops.promptcache.apply_rotary_pos_emb(grad_q.contiguous(), grad_k.contiguous(), cos, sin_t,
                                                        ctx.backend)
    dcos = dsin = None
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        r = cos.shape[-1]
        dcos = torch.zeros(cos.shape, dtype=torch.float32, device=cos.device)
        dsin = torch.zeros_like(dcos)
        for x, g in ((q, grad_q), (k, grad_k)):
            xr, gr = x[..., :r].float(), g[..., :r].float()
            rot = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
            dcos += (gr * xr).sum(1).sum(0, keepdim=True) if cos.shape[0] == 1 else (gr * xr).sum(1)
            dsin += (gr * rot).sum(1).sum(0, keepdim=True) if cos.shape[0] == 1 else (gr * rot).sum(1)
        dcos, dsin = dcos.to(cos.dtype), dsin.to(sin.dtype)
    return dq, dk, dcos, dsin, None


apply_rotary_pos_emb_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)


def onednn_linear_usable(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`linear_impl` hands ``x @ weight.T`` to oneDNN: fp32 CPU tensors of a
    build with oneDNN, a 2D weight and no autograd graph to record."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and x.dim() >= 1 and torch.backends.mkldnn.is_available()
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
