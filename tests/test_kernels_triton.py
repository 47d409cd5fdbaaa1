"""Lane 2: the Triton kernels themselves vs the references (``backend="triton"``).

On CPU they run in the Triton interpreter (conftest sets ``TRITON_INTERPRET=1``), so shapes
are tiny; on CUDA the same tests run compiled (lane 3). The launch counter proves that
the Triton launcher ran, not the torch fallback. bf16 is checked with fp32 math.
"""

from __future__ import annotations

import pytest
import torch

from pckernels import extras, ops
from pckernels.kernels import HAS_TRITON, triton_runnable

from test_ops import (
    GATHER_CASES,
    GATHER_ROTATE_CASES,
    ROPE_CASES,
    SCATTER_CASES,
    check_cos_sin,
    check_rope_positions,
    inv_freq_for,
    opcheck_samples,
    randn,
    run_gather,
    run_gather_rotate,
    run_scatter,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not (HAS_TRITON and triton_runnable(torch.device(DEVICE))),
                       reason="Triton cannot run here (no CUDA and TRITON_INTERPRET unset at import)"),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def launches():
    """Yields a function returning the Triton launches of one kernel since the test began."""
    ops.reset_launch_counts()
    yield lambda name: ops.launch_counts().get(name, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: f"L{c[0]}H{c[1]}D{c[2]}")
def test_gather_concat_triton(dtype, case, launches):
    run_gather(DEVICE, dtype, case, torch.int32, strided=dtype == torch.float16, backend="triton")
    assert launches("gather_concat") == 1


def test_gather_concat_triton_device_table_and_max_rows(launches):
    """A table already on the device, with and without the max_rows hint; int64 entries."""
    L, H, D = 2, 1, 6
    blocks = [randn(L, 2, H, 7, D, device=DEVICE), randn(L, 2, H, 5, D, device=DEVICE)]
    table = torch.tensor([[1, 0, 0, 5], [0, 2, 5, 3]], device=DEVICE)
    for max_rows in (None, 5):
        out = torch.full((L, 2, H, 9, D), float("nan"), device=DEVICE)
        ops.gather_concat(out, blocks, table, max_rows=max_rows, backend="triton")
        assert torch.equal(out[:, :, :, :5], blocks[1]) and torch.equal(out[:, :, :, 5:8], blocks[0][:, :, :, 2:5])
        assert out[:, :, :, 8].isnan().all()
    assert launches("gather_concat") == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GATHER_ROTATE_CASES, ids=lambda c: f"L{c[0]}H{c[1]}D{c[2]}R{2 * c[3]}")
def test_gather_rotate_triton(dtype, case, launches):
    run_gather_rotate(DEVICE, dtype, case, torch.int64, strided=dtype == torch.float16, backend="triton",
                      zero_layer=0)
    assert launches("gather_rotate") == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SCATTER_CASES, ids=lambda c: f"B{c[0]}H{c[1]}D{c[3]}q{len(c[4])}")
def test_scatter_rows_triton(dtype, case, launches):
    run_scatter(DEVICE, dtype, case, torch.int32 if dtype == torch.float16 else torch.int64,
                strided=dtype == torch.bfloat16, backend="triton")
    assert launches("scatter_rows") == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"B{c[0]}H{c[1]}S{c[2]}D{c[3]}R{c[4]}")
def test_rope_at_positions_triton(dtype, case, launches):
    check_rope_positions(DEVICE, dtype, case, "triton", strided=dtype == torch.float16)
    check_rope_positions(DEVICE, dtype, case, "triton", batched=True, inplace=True)
    assert launches("rope") == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"B{c[0]}H{c[1]}S{c[2]}D{c[3]}R{c[4]}")
def test_apply_rotary_pos_emb_triton(dtype, case, launches):
    check_cos_sin(DEVICE, dtype, case, "triton", strided=dtype == torch.bfloat16)
    assert launches("rope") == 1


def test_rerotate_triton(launches):
    L, H, n, D = 2, 1, 7, 6
    inv = inv_freq_for(6).to(DEVICE)
    block = randn(L, 2, H, n, D, device=DEVICE)
    expect = block.clone()
    extras.rerotate_block(expect, 11, inv, backend="torch")
    got = extras.rerotate_block(block.clone(), 11, inv, backend="triton")
    torch.testing.assert_close(got, expect, atol=2e-6, rtol=2e-6)
    assert launches("rope") == 1


@pytest.mark.parametrize("i", range(8))
def test_registered_ops_run_triton(i, launches):
    """Each registered op, eagerly, with backend='triton', agrees with its torch path."""
    name, args = opcheck_samples(DEVICE)[i]
    op = getattr(torch.ops.promptcache, name)

    def run(backend):
        cloned = [[a.detach().clone() for a in x] if isinstance(x, list)
                  else x.detach().clone() if isinstance(x, torch.Tensor) else x for x in args]
        res = op(*cloned, backend=backend)
        return res, cloned

    want, want_args = run("torch")
    before = sum(ops.launch_counts().values())
    got, got_args = run("triton")
    assert sum(ops.launch_counts().values()) == before + 1
    for a, b in zip(want_args, got_args):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6, equal_nan=True)
    if want is not None:
        for a, b in zip(want, got):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


@pytest.mark.skipif(DEVICE != "cuda", reason="opcheck of the Triton path needs compiled Triton (CUDA)")
@pytest.mark.parametrize("i", range(8))
def test_opcheck_triton_cuda(i):
    from torch.library import opcheck

    name, args = opcheck_samples("cuda")[i]
    res = opcheck(getattr(torch.ops.promptcache, name), args, {"backend": "triton"})
    assert all(v == "SUCCESS" for v in res.values()), res


def test_forced_triton_without_runtime_raises(monkeypatch, launches):
    """Forcing Triton on CPU tensors without the interpreter raises, on every machine; on CUDA
    tensors it runs the compiled kernel, which needs no interpreter. Without Triton it raises."""
    from pckernels.extras.rope.naive import rope_at_positions_ref
    from pckernels.kernels import _common

    monkeypatch.setattr(_common, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        extras.rope_at_positions(torch.zeros(1, 1, 1, 2), torch.tensor([0]), inv_freq_for(2), backend="triton")
    assert launches("rope") == 0
    if DEVICE == "cuda":
        x, pos, inv = randn(1, 2, 3, 6, device="cuda"), torch.tensor([4, 0, 9]), inv_freq_for(6)
        got = extras.rope_at_positions(x.clone(), pos.cuda(), inv.cuda(), backend="triton")
        assert launches("rope") == 1
        torch.testing.assert_close(got.cpu(), rope_at_positions_ref(x.cpu(), pos, inv), atol=2e-6, rtol=2e-6)
    monkeypatch.setattr(_common, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="cannot run"):
        extras.rope_at_positions(randn(1, 1, 1, 2, device=DEVICE), torch.tensor([0], device=DEVICE),
                                 inv_freq_for(2).to(DEVICE), backend="triton")
    assert launches("rope") == (DEVICE == "cuda")
