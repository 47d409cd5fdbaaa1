"""``ops.linear`` (oneDNN GEMM on CPU fp32) against ``F.linear`` in float64, and its per-instance
wiring into models (:mod:`pckernels.integration.linear`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

from pckernels import ops
from pckernels.integration.linear import apply_fast_linear, fast_linear_applied, revert_fast_linear
from pckernels.ops import _library as lib

ONEDNN = torch.backends.mkldnn.is_available()


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("shape", [(1, 7), (1, 1, 7), (3, 5, 7), (13, 7), (0, 7), (2, 1, 1, 7)])
@pytest.mark.parametrize("out_features", [1, 9, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(shape, out_features, with_bias):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    w = torch.randn(out_features, shape[-1])
    b = torch.randn(out_features) if with_bias else None
    got = ops.linear(x, w, b)
    assert got.shape == (*shape[:-1], out_features) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference(x, w, b), rtol=0, atol=2e-5)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=0, atol=2e-5)


def test_linear_strided_input_and_weight():
    torch.manual_seed(1)
    x = torch.randn(5, 22)[:, ::2]
    w = torch.randn(11, 6).t()
    assert not x.is_contiguous() and not w.is_contiguous()
    torch.testing.assert_close(ops.linear(x, w).double(), reference(x, w, None), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_linear_other_dtypes_are_f_linear(dtype):
    torch.manual_seed(2)
    x, w = torch.randn(3, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype)
    assert not lib.onednn_linear_usable(x, w)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))


def test_linear_torch_backend_is_f_linear():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert torch.equal(ops.linear(x, w, backend="torch"), F.linear(x, w))


def test_linear_autograd_falls_back_and_has_gradients():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    assert not lib.onednn_linear_usable(x, w)
    ops.linear(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None


def test_a_strided_weight_goes_to_f_linear():
    """The transposed CPU path leaves the HF modules' weights as views of ``[in, out]`` tensors
    (columns of a fused weight): oneDNN would reorder such a weight on every call, so the op hands
    it to ``F.linear`` — bitwise F.linear's product."""
    torch.manual_seed(3)
    fused = torch.randn(24, 37)  # [in, out_total]
    w = fused[:, 5:16].t()  # [11, 24], strides (1, 37)
    x = torch.randn(7, 24)
    assert not w.is_contiguous()
    assert not lib.onednn_linear_usable(x, w)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")
def test_linear_auto_takes_onednn_on_cpu_fp32():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert lib.onednn_linear_usable(x, w)


def test_linear_opcheck():
    x, w, b = torch.randn(3, 5, 7), torch.randn(9, 7), torch.randn(9)
    for args in ((x, w, b), (x, w, None)):
        res = opcheck(torch.ops.promptcache.linear, args, {"backend": "auto"})
        assert all(v == "SUCCESS" for v in res.values()), res


def test_linear_under_compile():
    x, w = torch.randn(4, 7), torch.randn(9, 7)
    fn = torch.compile(lambda a, b: ops.linear(a, b) + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(x, w), F.linear(x, w) + 1, rtol=0, atol=2e-5)


class CustomLinear(torch.nn.Linear):
    """A subclass with its own forward (as Falcon's FalconLinear): must be left alone."""

    def forward(self, input):
        return super().forward(input) * 2


def small_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5, bias=False),
                               CustomLinear(5, 3))


def test_apply_is_per_instance_and_reversible():
    model, other = small_model(), small_model()
    x = torch.randn(6, 8)
    with torch.no_grad():
        before = model(x)
        assert apply_fast_linear(model) == 2
        assert apply_fast_linear(model) == 0
        assert fast_linear_applied(model) and not fast_linear_applied(other)
        assert type(other[0]) is torch.nn.Linear and type(model[3]) is CustomLinear
        assert isinstance(model[0], torch.nn.Linear)
        after = model(x)
        torch.testing.assert_close(after, before, rtol=0, atol=2e-5)
        torch.testing.assert_close(other(x), before, rtol=0, atol=0)
        assert set(model.state_dict()) == set(other.state_dict())
        assert revert_fast_linear(model) == 2
        assert type(model[0]) is torch.nn.Linear and not fast_linear_applied(model)


def test_adapter_applies_fast_linear_to_its_model_only():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pckernels.integration.adapters import adapter_for

    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=50)
    model, other = AutoModelForCausalLM.from_config(cfg).eval(), AutoModelForCausalLM.from_config(cfg).eval()
    other.load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        want = other(ids).logits
        adapter_for(model)
        got = model(ids).logits
    assert fast_linear_applied(model) and not fast_linear_applied(other)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
