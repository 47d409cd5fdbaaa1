"""The RoPE extras as ``torch.ops.promptcache.*`` (``custom_op``, registered when this module is
imported) and their Python API, which calls the implementations directly in eager mode and the
registered ops under ``torch.compile`` or when autograd is needed (as :mod:`pckernels.ops`)."""

from __future__ import annotations

import torch
from torch.library import custom_op

from pckernels.extras import rope as _r
from pckernels.kernels._common import resolve_backend, use_triton

Tensor = torch.Tensor


def _check_positions(x: Tensor, inv_freq: Tensor) -> None:
    _r.check_rope_x(x, inv_freq.shape[0])
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be [R / 2], got {tuple(inv_freq.shape)}")


def rope_at_positions_impl(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scaling: float,
                           out: Tensor, backend: str = "auto") -> None:
    """``out [B, H, S, D]`` <- ``x`` rotated at ``positions [S] | [B, S]`` (``out`` may be ``x``)."""
    _check_positions(x, inv_freq)
    if out is not x and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out must match x: {tuple(x.shape)} {x.dtype} {x.device}")
    if use_triton(x.device, backend):
        _r.rope_positions_triton(x, positions, inv_freq, attention_scaling, out)
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


def apply_rotary_pos_emb_impl(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                              backend: str = "auto") -> tuple[Tensor, Tensor]:
    """HF's ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``): ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]``,
    ``cos, sin [B|1, S, R]``, R <= D (the rest passes through). Returns new tensors."""
    _check_cos_sin(q, k, cos, sin)
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    if use_triton(q.device, backend):
        _r.rope_cos_sin_triton(q, k, cos, sin, q_out, k_out)
    else:
        _r.rope_cos_sin_torch(q, cos, sin, q_out)
        _r.rope_cos_sin_torch(k, cos, sin, k_out)
    return q_out, k_out


def rerotate_keys_impl(k: Tensor, delta: Tensor, inv_freq: Tensor, backend: str = "auto") -> None:
    """In place, ``k [B, H, n, D]`` rotated at p -> at p + delta; ``delta`` is 0-d, ``[n]`` or ``[B, n]``."""
    pos = delta.reshape(1).expand(k.shape[2]) if delta.dim() == 0 else delta
    rope_at_positions_impl(k, pos, inv_freq, 1.0, k, backend)


@custom_op("promptcache::rope_at_positions", mutates_args={"out"})
def rope_at_positions_op(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scaling: float,
                         out: Tensor, backend: str = "auto") -> None:
    """Registered :func:`rope_at_positions_impl` into a separate ``out``."""
    rope_at_positions_impl(x, positions, inv_freq, attention_scaling, out, backend)


@rope_at_positions_op.register_fake
def _rope_at_positions_fake(x, positions, inv_freq, attention_scaling, out, backend="auto") -> None:
    _check_positions(x, inv_freq)


@custom_op("promptcache::rope_at_positions_", mutates_args={"x"})
def rope_at_positions_inplace_op(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scaling: float,
                                 backend: str = "auto") -> None:
    """Registered :func:`rope_at_positions_impl`, in place on ``x``."""
    rope_at_positions_impl(x, positions, inv_freq, attention_scaling, x, backend)


@rope_at_positions_inplace_op.register_fake
def _rope_at_positions_inplace_fake(x, positions, inv_freq, attention_scaling, backend="auto") -> None:
    _check_positions(x, inv_freq)


@custom_op("promptcache::rerotate_keys_", mutates_args={"k"})
def rerotate_keys_op(k: Tensor, delta: Tensor, inv_freq: Tensor, backend: str = "auto") -> None:
    """Registered :func:`rerotate_keys_impl` (in place)."""
    rerotate_keys_impl(k, delta, inv_freq, backend)


@rerotate_keys_op.register_fake
def _rerotate_keys_fake(k, delta, inv_freq, backend="auto") -> None:
    _check_positions(k, inv_freq)


@custom_op("promptcache::apply_rotary_pos_emb", mutates_args=())
def apply_rotary_pos_emb_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                            backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Registered :func:`apply_rotary_pos_emb_impl`."""
    return apply_rotary_pos_emb_impl(q, k, cos, sin, backend)


@apply_rotary_pos_emb_op.register_fake
def _apply_rotary_pos_emb_fake(q, k, cos, sin, backend="auto") -> tuple[Tensor, Tensor]:
    _check_cos_sin(q, k, cos, sin)
    return torch.empty_like(q), torch.empty_like(k)


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


def _use_op() -> bool:
    return torch.compiler.is_compiling()


def rope_at_positions(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scaling: float = 1.0, *,
                      out: Tensor | None = None, backend: str | None = None) -> Tensor:
    """Rotate ``x [B, H, S, D]`` at integer ``positions [S] | [B, S]`` (any order, gaps allowed).

    HF conventions: rotate-half over the first ``R = 2 * len(inv_freq)`` dims (the rest pass
    through), ``cos/sin = cos/sin(pos * inv_freq) * attention_scaling`` in fp32. In place when
    ``out`` is None; returns the rotated tensor.
    """
    b = resolve_backend(backend)
    s = float(attention_scaling)
    if out is None:
        if _use_op():
            torch.ops.promptcache.rope_at_positions_(x, positions, inv_freq, s, b)
        else:
            rope_at_positions_impl(x, positions, inv_freq, s, x, b)
        return x
    if _use_op():
        torch.ops.promptcache.rope_at_positions(x, positions, inv_freq, s, out, b)
    else:
        rope_at_positions_impl(x, positions, inv_freq, s, out, b)
    return out


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, *,
                         backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Drop-in for HF's ``apply_rotary_pos_emb``: q and k in one launch, new tensors returned.

    ``unsqueeze_dim=1``: ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]``; ``unsqueeze_dim=2``:
    ``[B, S, H, D]``. ``cos, sin [B|1, S, R]`` with R <= D (the rest passes through).
    Differentiable (through the registered op) when autograd needs it.
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    b = resolve_backend(backend)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))
    if grad or _use_op():
        q_out, k_out = torch.ops.promptcache.apply_rotary_pos_emb(q, k, cos, sin, b)
    else:
        q_out, k_out = apply_rotary_pos_emb_impl(q, k, cos, sin, b)
    if unsqueeze_dim == 2:
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


def rerotate_keys(k: Tensor, delta: int | Tensor, inv_freq: Tensor, *, backend: str | None = None) -> Tensor:
    """Move keys rotated at positions p to p + delta, in place: ``k <- R(delta) k``; returns ``k``.

    ``k [B, H, n, D]`` (e.g. ``block[:, 0]`` of a KV block, B = layers); ``delta`` is an int, a
    0-d tensor, ``[n]`` or ``[B, n]`` (may be negative). No attention scaling is applied:
    the keys already carry it.
    """
    if not isinstance(delta, torch.Tensor):
        delta = torch.full((), int(delta), dtype=torch.int64, device=k.device)
    b = resolve_backend(backend)
    if _use_op():
        torch.ops.promptcache.rerotate_keys_(k, delta, inv_freq, b)
    else:
        rerotate_keys_impl(k, delta, inv_freq, b)
    return k


def rerotate_block(block: Tensor, delta: int | Tensor, inv_freq: Tensor, *, backend: str | None = None) -> Tensor:
    """Re-rotate the keys of a KV block ``[L, 2, H, n, D]`` in place (values untouched); returns ``block``."""
    rerotate_keys(block[:, 0], delta, inv_freq, backend=backend)
    return block
