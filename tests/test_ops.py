"""Lane 1 (torch path, always) and lane 3 (the same tests on CUDA, where ``auto`` = Triton).

References (each op's ``naive.py``) vs the ops over odd, non-power-of-two and
size-1 shapes, strided inputs and int32/int64 indices. Outputs start NaN-poisoned and are
compared bit for bit, so every intended row must be written and every other row stays NaN.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.library import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

from pckernels import extras, ops
from pckernels.extras.rope.naive import cos_sin_ref, rope_at_positions_ref, rope_cos_sin_ref
from pckernels.kernels.gather_concat.naive import gather_concat_ref
from pckernels.kernels.gather_rotate.naive import gather_rotate_ref, rerotate_keys_ref
from pckernels.kernels.scatter_rows.naive import scatter_rows_ref

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def backend_for(device: str) -> str:
    """Lane 1 on CPU forces the torch path; on CUDA ``auto`` compiles Triton (lane 3)."""
    return "torch" if device == "cpu" else "auto"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a.contiguous()).cpu(), bits(b.contiguous()).cpu())


def randn(*shape, dtype=torch.float32, device="cpu", strided=False):
    """Random tensor; ``strided`` returns a non-contiguous view (last dim every other element)."""
    if strided:
        full = torch.randn(*shape[:-1], 2 * shape[-1], dtype=torch.float32).to(device=device, dtype=dtype)
        return full[..., ::2]
    return torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype)


def nan_buffer(*shape, dtype, device, strided=False):
    if strided:
        full = torch.full((*shape[:-2], shape[-2] + 3, shape[-1] + 5), float("nan"), dtype=dtype, device=device)
        return full[..., 1:1 + shape[-2], 2:2 + shape[-1]]
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# ----------------------------------------------------------------------------- gather-concat

GATHER_CASES = [  # (L, H, D, block lengths, table rows)
    (1, 1, 2, [1], [(0, 0, 0, 1)]),
    (2, 1, 6, [7, 33], [(1, 5, 0, 20), (0, 0, 20, 7), (1, 32, 30, 1)]),
    (3, 2, 64, [7, 1, 33], [(2, 0, 0, 33), (1, 0, 33, 1), (0, 2, 36, 5)]),
    (1, 3, 80, [33], [(0, 0, 40, 33), (0, 10, 3, 2)]),
    (2, 1, 96, [7, 7], [(0, 0, 0, 7), (1, 0, 7, 7), (0, 3, 20, 0)]),
]


def make_blocks(L, H, D, lens, dtype, device, strided):
    """Random blocks ``[L, 2, H, n, D]`` of ``lens``; with ``strided`` every other one a
    transposed view (heads and rows swapped in memory)."""
    blocks = []
    for i, n in enumerate(lens):
        b = randn(L, 2, H, n, D, dtype=dtype, device=device)
        if strided and i % 2 == 0:
            b = randn(L, 2, n, H, D, dtype=dtype, device=device).transpose(2, 3)
        blocks.append(b)
    return blocks


def run_gather(device, dtype, case, table_dtype, strided, backend, cap_extra=6):
    L, H, D, lens, rows = case
    cap = max(d + n for _, _, d, n in rows) + cap_extra
    blocks = make_blocks(L, H, D, lens, dtype, device, strided)
    table = torch.tensor(rows, dtype=table_dtype).reshape(-1, 4)
    out = nan_buffer(L, 2, H, cap, D, dtype=dtype, device=device, strided=strided)
    expect = out.clone()
    gather_concat_ref(expect, blocks, table)
    ops.gather_concat(out, blocks, table, backend=backend)
    assert_bits_equal(out, expect)
    written = torch.zeros(cap, dtype=torch.bool)
    for _, _, d, n in rows:
        written[d:d + n] = True
    assert not out[:, :, :, written.to(device)].isnan().any()
    assert out[:, :, :, (~written).to(device)].isnan().all()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: f"L{c[0]}H{c[1]}D{c[2]}")
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_gather_concat(device, dtype, case, table_dtype):
    run_gather(device, dtype, case, table_dtype, strided=False, backend=backend_for(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GATHER_CASES[1:3], ids=lambda c: f"L{c[0]}H{c[1]}D{c[2]}")
def test_gather_concat_strided(device, case):
    run_gather(device, torch.float16, case, torch.int64, strided=True, backend=backend_for(device))


def test_gather_concat_rejects_bad_table():
    out = torch.zeros(1, 2, 1, 4, 2)
    blocks = [torch.zeros(1, 2, 1, 3, 2)]
    with pytest.raises(IndexError):
        ops.gather_concat(out, blocks, torch.tensor([[0, 1, 0, 3]]), backend="torch")
    with pytest.raises(IndexError):
        ops.gather_concat(out, blocks, torch.tensor([[1, 0, 0, 1]]), backend="torch")
    with pytest.raises(ValueError):
        ops.gather_concat(out, [torch.zeros(1, 2, 2, 3, 2)], torch.tensor([[0, 0, 0, 1]]), backend="torch")


# ----------------------------------------------------------------------------- slot scatter

SCATTER_CASES = [  # (B, H, cap, D, rows)
    (1, 1, 1, 2, [0]),
    (1, 3, 40, 6, [39, 0, 17, 5, 6, 7, 30]),
    (2, 2, 9, 64, [8]),
    (1, 1, 50, 80, list(range(49, 16, -1))),
    (1, 2, 12, 96, [11, 3, 0, 7, 2, 9, 4]),
]


def run_scatter(device, dtype, case, rows_dtype, strided, backend):
    B, H, cap, D, rows = case
    q = len(rows)
    k = randn(B, H, q, D, dtype=dtype, device=device, strided=strided)
    v = randn(B, q, H, D, dtype=dtype, device=device).transpose(1, 2) if strided else randn(B, H, q, D, dtype=dtype, device=device)
    buf = nan_buffer(2, B, H, cap, D, dtype=dtype, device=device, strided=strided)
    k_out, v_out = buf[0], buf[1]
    r = torch.tensor(rows, dtype=rows_dtype, device=device)
    ek, ev = k_out.clone(), v_out.clone()
    scatter_rows_ref(ek, ev, k, v, r)
    ops.scatter_rows(k_out, v_out, k, v, r, backend=backend)
    assert_bits_equal(k_out, ek)
    assert_bits_equal(v_out, ev)
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[rows] = False
    for t in (k_out, v_out):
        assert not t[:, :, rows].isnan().any()
        assert t[:, :, untouched.to(device)].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SCATTER_CASES, ids=lambda c: f"B{c[0]}H{c[1]}D{c[3]}q{len(c[4])}")
@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
def test_scatter_rows(device, dtype, case, rows_dtype):
    run_scatter(device, dtype, case, rows_dtype, strided=False, backend=backend_for(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SCATTER_CASES[1:4], ids=lambda c: f"B{c[0]}H{c[1]}D{c[3]}q{len(c[4])}")
def test_scatter_rows_strided(device, case):
    run_scatter(device, torch.bfloat16, case, torch.int32, strided=True, backend=backend_for(device))


def test_write_rows_adapter():
    class Buf:
        data = torch.full((2, 2, 3, 10, 4), float("nan"))

    k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
    ops.write_rows(Buf, 1, k, v, torch.tensor([7, 2]), 0, backend="torch")
    ops.write_rows(Buf, 0, k, v, None, 4, backend="torch")
    assert torch.equal(Buf.data[1, 0, :, [7, 2]], k[0]) and torch.equal(Buf.data[1, 1, :, [7, 2]], v[0])
    assert torch.equal(Buf.data[0, 0, :, 4:6], k[0]) and torch.equal(Buf.data[0, 1, :, 4:6], v[0])
    assert Buf.data.isnan().sum() == Buf.data.numel() - 4 * 3 * 2 * 4


# ----------------------------------------------------------------------------- RoPE

ROPE_CASES = [  # (B, H, S, D, rotary dim R)
    (1, 1, 1, 2, 2),
    (2, 3, 7, 6, 6),
    (1, 2, 33, 64, 64),
    (1, 1, 7, 80, 40),
    (2, 1, 5, 96, 96),
]


def inv_freq_for(r: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))


def positions_for(B: int, S: int, batched: bool, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(S)
    p = torch.randint(0, 3000, (B if batched else 1, S), generator=g).to(dtype)
    return p if batched else p[0]


def check_rope_positions(device, dtype, case, backend, *, strided=False, batched=False, inplace=False):
    B, H, S, D, R = case
    x = randn(B, H, S, D, dtype=dtype, device=device, strided=strided)
    inv = inv_freq_for(R).to(device)
    pos = positions_for(B, S, batched).to(device)
    expect = rope_at_positions_ref(x.cpu(), pos.cpu(), inv.cpu(), 1.25)
    if inplace:
        got = x.clone()
        extras.rope_at_positions(got, pos, inv, 1.25, backend=backend)
    else:
        got = nan_buffer(B, H, S, D, dtype=dtype, device=device, strided=strided)
        res = extras.rope_at_positions(x, pos, inv, 1.25, out=got, backend=backend)
        assert res is got
        assert_bits_equal(got[..., R:], x[..., R:])
    torch.testing.assert_close(got.cpu().float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"B{c[0]}H{c[1]}S{c[2]}D{c[3]}R{c[4]}")
def test_rope_at_positions(device, dtype, case):
    check_rope_positions(device, dtype, case, backend_for(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ROPE_CASES[1:4], ids=lambda c: f"B{c[0]}H{c[1]}S{c[2]}D{c[3]}R{c[4]}")
def test_rope_at_positions_strided_batched_inplace(device, case):
    check_rope_positions(device, torch.float32, case, backend_for(device), strided=True, batched=True)
    check_rope_positions(device, torch.float16, case, backend_for(device), batched=True, inplace=True)
    check_rope_positions(device, torch.bfloat16, case, backend_for(device), strided=True, inplace=True)


def check_cos_sin(device, dtype, case, backend, hq=None, strided=False):
    B, H, S, D, R = case
    q = randn(B, hq or H + 1, S, D, dtype=dtype, device=device, strided=strided)
    k = randn(B, H, S, D, dtype=dtype, device=device)
    cos, sin = cos_sin_ref(positions_for(B, S, True), inv_freq_for(R), 1.1)
    cos, sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
    if B > 1:
        cos, sin = cos[:1], sin[:1]
    qo, ko = extras.apply_rotary_pos_emb(q, k, cos, sin, backend=backend)
    for x, o in ((q, qo), (k, ko)):
        expect = rope_cos_sin_ref(x.cpu(), cos.cpu(), sin.cpu()).to(dtype)
        torch.testing.assert_close(o.cpu().float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert_bits_equal(o[..., R:], x[..., R:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"B{c[0]}H{c[1]}S{c[2]}D{c[3]}R{c[4]}")
def test_apply_rotary_pos_emb(device, dtype, case):
    check_cos_sin(device, dtype, case, backend_for(device), strided=case[3] % 4 == 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_pos_emb_matches_hf(device, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    B, Hq, Hk, S, D = 2, 4, 2, 9, 64
    q = randn(B, S, Hq, D, dtype=dtype, device=device).transpose(1, 2)
    k = randn(B, S, Hk, D, dtype=dtype, device=device).transpose(1, 2)
    cos, sin = cos_sin_ref(positions_for(B, S, True), inv_freq_for(D), 1.0)
    cos, sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
    hq, hk = hf_apply(q, k, cos, sin)
    gq, gk = extras.apply_rotary_pos_emb(q, k, cos, sin, backend=backend_for(device))
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(gq, hq, atol=tol, rtol=tol)
    torch.testing.assert_close(gk, hk, atol=tol, rtol=tol)
    hq2, hk2 = hf_apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    gq2, gk2 = extras.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2,
                                           backend=backend_for(device))
    torch.testing.assert_close(gq2, hq2, atol=tol, rtol=tol)
    torch.testing.assert_close(gk2, hk2, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_at_positions_matches_hf_rotary_embedding(device):
    """Discontinuous positions and a YaRN attention scaling, against HF's rotary embedding + apply."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                       "original_max_position_embeddings": 2048})
    emb = LlamaRotaryEmbedding(cfg).to(device)
    assert emb.attention_scaling != 1.0
    pos = torch.tensor([[0, 1, 2, 900, 901, 3, 4000, 17]], device=device)
    q = randn(1, 2, 8, 32, device=device)
    k = randn(1, 1, 8, 32, device=device)
    cos, sin = emb(q, pos)
    hq, hk = hf_apply(q, k, cos, sin)
    be = backend_for(device)
    gq = extras.rope_at_positions(q, pos, emb.inv_freq, emb.attention_scaling, out=torch.empty_like(q), backend=be)
    gk = extras.rope_at_positions(k.clone(), pos[0], emb.inv_freq, emb.attention_scaling, backend=be)
    torch.testing.assert_close(gq, hq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gk, hk, atol=1e-5, rtol=1e-5)


class DispatchedOps(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher's Python mode."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_apply_rotary_pos_emb_autograd(device):
    """With grads needed, forward and backward run the registered op (its custom backward)."""
    q = randn(1, 3, 5, 6, device=device).requires_grad_()
    k = randn(1, 1, 5, 6, device=device).requires_grad_()
    cos, sin = cos_sin_ref(torch.arange(5)[None], inv_freq_for(4))
    cos, sin = cos.to(device).requires_grad_(), sin.to(device).requires_grad_()
    with DispatchedOps() as dispatched:
        qo, ko = extras.apply_rotary_pos_emb(q, k, cos, sin, backend=backend_for(device))
        (qo.square().sum() + (ko * 3).sum()).backward()
    assert dispatched.names.count("promptcache.apply_rotary_pos_emb.default") == 2
    grads = [t.grad.clone() for t in (q, k, cos, sin)]
    for t in (q, k, cos, sin):
        t.grad = None
    rq = rope_cos_sin_ref(q, cos, sin)
    rk = rope_cos_sin_ref(k, cos, sin)
    (rq.square().sum() + (rk * 3).sum()).backward()
    for g, t in zip(grads, (q, k, cos, sin)):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- re-rotation

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rerotate_matches_encoding_at_shifted_positions(device, dtype):
    """R(d) R(p) k == R(p + d) k up to rounding (bounds measured by perf/kernels/rerotate_error.py)."""
    L, H, n, D = 2, 2, 33, 64
    inv = inv_freq_for(D).to(device)
    raw = randn(L, H, n, D, device=device)
    p = torch.arange(100, 100 + n, device=device)
    for delta in (37, -90, 3000):
        moved = extras.rope_at_positions(raw.clone(), p, inv, backend="torch").to(dtype)
        extras.rerotate_keys(moved, delta, inv, backend=backend_for(device))
        direct = extras.rope_at_positions(raw.clone(), p + delta, inv, backend="torch").to(dtype)
        err = (moved.float() - direct.float()).abs().max().item()
        bound = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 6e-2}[dtype]
        assert err < bound, (delta, err)


@pytest.mark.parametrize("device", DEVICES)
def test_rerotate_block_per_token_delta(device):
    L, H, n, D = 3, 1, 7, 6
    block = randn(L, 2, H, n, D, device=device)
    inv = inv_freq_for(4).to(device)
    delta = torch.tensor([5, -3, 0, 2, 2, 9, 1], device=device)
    expect = block.clone()
    expect[:, 0] = rerotate_keys_ref(block[:, 0].cpu(), delta.cpu(), inv.cpu()).to(device)
    got = extras.rerotate_block(block.clone(), delta, inv, backend=backend_for(device))
    torch.testing.assert_close(got, expect, atol=1e-6, rtol=1e-6)
    assert_bits_equal(got[:, 1], block[:, 1])


# ----------------------------------------------------------------------------- gather + rotate

GATHER_ROTATE_CASES = [  # (L, H, D, half, block lengths, table rows (block, src, dst, n, delta))
    (1, 1, 2, 1, [1], [(0, 0, 0, 1, 5)]),
    (2, 1, 6, 2, [7, 33], [(1, 5, 0, 20, -17), (0, 0, 20, 7, 0), (1, 32, 30, 1, 4099)]),
    (3, 2, 64, 32, [7, 1, 33], [(2, 0, 0, 33, 1000), (1, 0, 33, 1, -1), (0, 2, 36, 5, 3)]),
    (2, 3, 80, 16, [33], [(0, 0, 40, 33, 77), (0, 10, 3, 2, -2000)]),
]
ROTATE_TOL = {torch.float32: 3e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run_gather_rotate(device, dtype, case, table_dtype, strided, backend, zero_layer=None):
    """NaN-poisoned ``out`` against :func:`gather_rotate_ref`: values and non-rotary key dims
    bit-exact, rotated dims within ``ROTATE_TOL``, unwritten rows still NaN. Layer ``zero_layer``
    gets a zero ``inv_freq`` row, which must copy its keys bit-exactly."""
    L, H, D, half, lens, rows = case
    cap = max(d + n for _, _, d, n, _ in rows) + 5
    blocks = make_blocks(L, H, D, lens, dtype, device, strided)
    inv = torch.stack([inv_freq_for(2 * half, 10000.0 * (1 + layer)) for layer in range(L)])
    if zero_layer is not None:
        inv[zero_layer] = 0
    table = torch.tensor(rows, dtype=table_dtype).reshape(-1, 5)
    out = nan_buffer(L, 2, H, cap, D, dtype=dtype, device=device, strided=strided)
    expect = out.cpu().clone()
    gather_rotate_ref(expect, [b.cpu() for b in blocks], table, inv)
    ops.gather_rotate(out, blocks, table, inv.to(device), backend=backend)
    got = out.cpu()
    assert_bits_equal(got[:, 1], expect[:, 1])
    assert_bits_equal(got[:, 0, :, :, 2 * half:], expect[:, 0, :, :, 2 * half:])
    rotary = (got[:, 0, :, :, :2 * half].float() - expect[:, 0, :, :, :2 * half].float()).nan_to_num(0.0)
    assert rotary.abs().max().item() <= ROTATE_TOL[dtype]
    assert torch.equal(got.isnan(), expect.isnan())
    if zero_layer is not None:
        assert_bits_equal(got[zero_layer], expect[zero_layer])
    for b, src, dst, n, delta in rows:
        if delta == 0 and n:
            assert_bits_equal(got[:, :, :, dst:dst + n], blocks[b][:, :, :, src:src + n].cpu())
    written = torch.zeros(cap, dtype=torch.bool)
    for _, _, d, n, _ in rows:
        written[d:d + n] = True
    assert not got[:, :, :, written].isnan().any() and got[:, :, :, ~written].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GATHER_ROTATE_CASES, ids=lambda c: f"L{c[0]}H{c[1]}D{c[2]}R{2 * c[3]}")
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_gather_rotate(device, dtype, case, table_dtype):
    run_gather_rotate(device, dtype, case, table_dtype, strided=table_dtype == torch.int32,
                      backend=backend_for(device), zero_layer=case[0] - 1 if case[0] > 1 else None)


@pytest.mark.parametrize("case", GATHER_ROTATE_CASES[1:], ids=lambda c: f"L{c[0]}H{c[1]}D{c[2]}R{2 * c[3]}")
def test_gather_rotate_cpu_pieces(monkeypatch, case):
    """The CPU path rotates fp32 keys in cache-sized pieces: pieces of a few rows (odd, cutting
    every block) give the reference's result."""
    from pckernels.kernels import gather_rotate

    L, H, D = case[:3]
    monkeypatch.setattr(gather_rotate, "GATHER_ROTATE_CHUNK", 3 * H * D * 4 // torch.get_num_threads() + 1)
    run_gather_rotate("cpu", torch.float32, case, torch.int64, strided=True, backend="torch", zero_layer=0)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_rotate_moves_keys_like_encoding_there(device):
    """A block's keys rotated at p, gathered with delta d, equal the keys rotated at p + d."""
    L, H, n, D = 2, 3, 9, 8
    inv = torch.stack([inv_freq_for(D), inv_freq_for(D, 500000.0)])
    raw = randn(L, 2, H, n, D, device=device)
    p = torch.arange(40, 40 + n, device=device)
    block = raw.clone()
    for layer in range(L):
        extras.rope_at_positions(block[layer, 0][None], p, inv[layer].to(device), backend="torch")
    out = torch.zeros(L, 2, H, n + 2, D, device=device)
    ops.gather_rotate(out, [block], torch.tensor([[0, 0, 2, n, 300]]), inv.to(device), backend=backend_for(device))
    for layer in range(L):
        direct = extras.rope_at_positions(raw[layer, 0][None].clone(), p + 300, inv[layer].to(device), backend="torch")
        torch.testing.assert_close(out[layer, 0, :, 2:][None], direct, atol=2e-5, rtol=1e-5)
    assert torch.equal(out[:, 1, :, 2:], raw[:, 1])


def test_gather_rotate_rejects_bad_arguments():
    out = torch.zeros(2, 2, 1, 8, 6)
    blocks = [torch.zeros(2, 2, 1, 4, 6)]
    inv = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\[M, 5\]"):
        ops.gather_rotate(out, blocks, torch.tensor([[0, 0, 0, 4]]), inv)
    with pytest.raises(ValueError, match="inv_freq"):
        ops.gather_rotate(out, blocks, torch.tensor([[0, 0, 0, 4, 1]]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="inv_freq"):
        ops.gather_rotate(out, blocks, torch.tensor([[0, 0, 0, 4, 1]]), torch.zeros(1, 3))
    with pytest.raises(IndexError):
        ops.gather_rotate(out, blocks, torch.tensor([[0, 2, 0, 4, 1]]), inv)
    assert not out.any()


# ----------------------------------------------------------------------------- opcheck / compile

def opcheck_samples(device: str):
    """One small sample per op (with odd sizes and strides)."""
    x = randn(2, 3, 5, 6, device=device, strided=True)
    pos = torch.tensor([3, 1, 4, 1, 5], device=device)
    inv = inv_freq_for(4).to(device)
    cos, sin = cos_sin_ref(pos[None], inv)
    q = randn(2, 4, 5, 6, device=device).requires_grad_()
    k = randn(2, 2, 5, 6, device=device).requires_grad_()
    blocks = [randn(2, 2, 3, 4, 6, device=device), randn(2, 2, 5, 3, 6, device=device).transpose(2, 3)]
    out = torch.zeros(2, 2, 3, 9, 6, device=device)
    kv_out = torch.zeros(2, 1, 3, 8, 6, device=device)
    return [
        ("gather_concat", (out, blocks, torch.tensor([[0, 0, 0, 4], [1, 1, 4, 2]], device=device), -1)),
        ("scatter_rows", (kv_out[0], kv_out[1], randn(1, 3, 2, 6, device=device),
                          randn(1, 3, 2, 6, device=device), torch.tensor([5, 2], dtype=torch.int32, device=device))),
        ("rope_at_positions", (x, pos, inv, 1.2, torch.empty(2, 3, 5, 6, device=device))),
        ("rope_at_positions_", (x.clone(), pos[None].expand(2, 5), inv, 1.2)),
        ("rerotate_keys_", (x.clone(), torch.tensor(-3, device=device), inv)),
        ("apply_rotary_pos_emb", (q, k, cos.to(device), sin.to(device))),
        ("apply_rotary_pos_emb", (q, k, cos.to(device).requires_grad_(), sin.to(device).requires_grad_())),
        ("gather_rotate", (out.clone(), blocks, torch.tensor([[0, 0, 0, 4, 7], [1, 1, 4, 2, -3]], device=device),
                           torch.stack([inv, torch.zeros_like(inv)]), -1)),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("i", range(8))
def test_opcheck(device, i):
    name, args = opcheck_samples(device)[i]
    op = getattr(torch.ops.promptcache, name)
    res = opcheck(op, args, {"backend": backend_for(device)})
    assert all(v == "SUCCESS" for v in res.values()), res


def graph_recorder(graphs: list):
    """A ``torch.compile`` backend that keeps each Dynamo graph's op packets, then runs Inductor."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append({getattr(n.target, "overloadpacket", n.target) for n in gm.graph.nodes
                       if n.op == "call_function"})
        return lookup_backend("inductor")(gm, example_inputs)

    return backend


@pytest.mark.parametrize("device", DEVICES)
def test_ops_under_torch_compile(device):
    """Inside a compiled function the API calls ``torch.ops.promptcache.*`` (the graph holds
    them, not the aten ops of the implementation), and the compiled results are right."""
    torch._dynamo.reset()
    be = backend_for(device)
    inv = inv_freq_for(4).to(device)

    def step(k_out, v_out, k, v, rows, x, pos):
        ops.scatter_rows(k_out, v_out, k, v, rows, backend=be)
        return extras.rope_at_positions(x, pos, inv, 1.0, out=torch.empty_like(x), backend=be) * 2

    k_out = torch.zeros(1, 2, 6, 4, device=device)
    v_out = torch.zeros_like(k_out)
    k, v = randn(1, 2, 3, 4, device=device), randn(1, 2, 3, 4, device=device)
    rows = torch.tensor([4, 0, 2], device=device)
    x, pos = randn(1, 2, 3, 6, device=device), torch.tensor([9, 2, 5], device=device)
    graphs: list[set] = []
    got = torch.compile(step, fullgraph=True, backend=graph_recorder(graphs))(k_out, v_out, k, v, rows, x, pos)
    assert len(graphs) == 1
    assert {torch.ops.promptcache.scatter_rows, torch.ops.promptcache.rope_at_positions} <= graphs[0]
    assert not {torch.ops.aten.index_copy_, torch.ops.aten.index_copy} & graphs[0]
    ek, ev = torch.zeros_like(k_out), torch.zeros_like(v_out)
    scatter_rows_ref(ek, ev, k, v, rows)
    assert torch.equal(k_out, ek) and torch.equal(v_out, ev)
    torch.testing.assert_close(got, rope_at_positions_ref(x, pos, inv) * 2, atol=1e-5, rtol=1e-5)


def test_backend_rejects_unknown_names(monkeypatch):
    args = (torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2),
            torch.tensor([0]))
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.scatter_rows(*args, backend="cuda")
    monkeypatch.setenv("PROMPTCACHE_KERNEL_BACKEND", "gpu")
    with pytest.raises(ValueError, match="'gpu'"):
        ops.scatter_rows(*args)


@pytest.mark.parametrize("env, backend, runs", [
    (None, None, "auto"),
    ("triton", None, "triton"),
    ("torch", None, "torch"),
    ("torch", "triton", "triton"),
    ("triton", "torch", "torch"),
    ("triton", "auto", "auto"),
])
def test_backend_override_switches_implementation(monkeypatch, env, backend, runs):
    """``backend=`` (first) and ``$PROMPTCACHE_KERNEL_BACKEND`` decide which implementation runs:
    spies on the Triton launcher and the torch path record the one that ran, the launch counter
    agrees, and the result matches the reference. ``auto`` is Triton on CUDA, torch on CPU."""
    from pckernels.extras import rope
    from pckernels.kernels import triton_runnable

    device = "cuda" if CUDA else "cpu"
    if not triton_runnable(torch.device(device)):
        pytest.skip("Triton cannot run here (no CUDA and TRITON_INTERPRET unset at import)")
    if runs == "auto":
        runs = "triton" if device == "cuda" else "torch"
    ran = []

    def spy(name):
        original = getattr(rope, name)

        def run(*args, **kwargs):
            ran.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(rope, name, run)

    spy("rope_positions_triton")
    spy("rope_positions_torch")
    if env is None:
        monkeypatch.delenv("PROMPTCACHE_KERNEL_BACKEND", raising=False)
    else:
        monkeypatch.setenv("PROMPTCACHE_KERNEL_BACKEND", env)
    ops.reset_launch_counts()
    x, pos, inv = randn(1, 3, 5, 6, device=device), torch.tensor([4, 0, 7, 7, 2], device=device), inv_freq_for(6)
    got = extras.rope_at_positions(x.clone(), pos, inv.to(device), 1.5, backend=backend)
    assert ran == [f"rope_positions_{runs}"]
    assert ops.launch_counts().get("rope", 0) == (runs == "triton")
    torch.testing.assert_close(got.cpu(), rope_at_positions_ref(x.cpu(), pos.cpu(), inv, 1.5), atol=2e-6, rtol=2e-6)


# ----------------------------------------------------------------------------- import pckernels

OP_NAMES = {"gather_concat", "gather_rotate", "scatter_rows", "row_attention", "linear", "rope_at_positions", "rope_at_positions_",
            "rerotate_keys_", "apply_rotary_pos_emb"}

IMPORT_ONLY = r"""
import sys
import torch
import pckernels
print(" ".join(sorted(dir(torch.ops.promptcache))))
print(" ".join(m for m in ("triton", "torch._inductor") if m in sys.modules))
from pckernels import extras, ops
k = torch.zeros(1, 1, 4, 2)
ops.scatter_rows(k, k.clone(), torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), torch.tensor([1]), backend="auto")
extras.rope_at_positions(torch.ones(1, 1, 3, 4), torch.arange(3), torch.ones(2), backend="auto")
print(" ".join(m for m in ("triton", "torch._inductor") if m in sys.modules))
"""

FRESH_IMPORT = r"""
import sys
import torch
{before}
import pckernels
print("registered at import:", "pckernels.ops._library" in sys.modules)
g = torch.Generator().manual_seed(0)
k, v = torch.randn(1, 3, 5, 6, generator=g), torch.randn(1, 3, 5, 6, generator=g)
rows = torch.tensor([8, 0, 3, 6, 1])
k_out, v_out = torch.full((1, 3, 9, 6), float("nan")), torch.full((1, 3, 9, 6), float("nan"))
torch.ops.promptcache.scatter_rows(k_out, v_out, k, v, rows, "torch")
x, pos, inv = torch.randn(2, 1, 5, 6, generator=g), torch.tensor([7, 0, 3, 3, 1]), torch.tensor([1.0, 0.01])
out = torch.full_like(x, float("nan"))
torch.ops.promptcache.rope_at_positions(x, pos, inv, 1.25, out, "torch")

from pckernels.extras.rope.naive import rope_at_positions_ref
from pckernels.kernels.scatter_rows.naive import scatter_rows_ref
ek, ev = torch.full_like(k_out, float("nan")), torch.full_like(v_out, float("nan"))
scatter_rows_ref(ek, ev, k, v, rows)
torch.testing.assert_close(k_out, ek, rtol=0, atol=0, equal_nan=True)
torch.testing.assert_close(v_out, ev, rtol=0, atol=0, equal_nan=True)
assert k_out[:, :, [2, 4, 5, 7]].isnan().all() and not k_out[:, :, rows].isnan().any()
torch.testing.assert_close(out, rope_at_positions_ref(x, pos, inv, 1.25), atol=2e-6, rtol=2e-6)
print("ops ok")
"""


def run_fresh(script: str) -> str:
    """Stdout of ``script`` run by a fresh interpreter from the repository root."""
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_pckernels_registers_every_op_without_triton():
    """``import pckernels`` registers every op at once (``dir(torch.ops.promptcache)`` lists them)
    without importing Triton (each kernel module loads when its Triton path first runs) or Inductor,
    and the eager API's CPU paths do not import them either."""
    names, after_import, after_calls = run_fresh(IMPORT_ONLY).split("\n")[:3]
    assert OP_NAMES <= set(names.split())
    assert after_import == ""
    assert after_calls == ""


@pytest.mark.parametrize("before", ["", "assert not hasattr(torch.ops.promptcache, 'scatter_rows')"],
                         ids=["fresh", "namespace-touched-first"])
def test_import_pckernels_makes_registered_ops_callable(before):
    """In a fresh interpreter ``import pckernels`` alone makes ``torch.ops.promptcache.*`` work,
    registered at import (also when ``torch.ops.promptcache`` was looked at before)."""
    out = run_fresh(FRESH_IMPORT.format(before=before))
    assert out.split("\n")[:2] == ["registered at import: True", "ops ok"]
