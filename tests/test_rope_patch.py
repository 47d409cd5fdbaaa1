"""The Liger-style RoPE patch: swaps HF's function in Llama-family modules, checked against HF."""

from __future__ import annotations

import importlib

import pytest
import torch

from pckernels import extras
from pckernels.extras import rope_patch


@pytest.fixture(autouse=True)
def _revert():
    rope_patch.revert()
    yield
    rope_patch.revert()


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def test_off_by_default_and_revert():
    mods = [importlib.import_module(f"transformers.models.{f}.modeling_{f}") for f in rope_patch.FAMILIES]
    originals = [m.apply_rotary_pos_emb for m in mods]
    assert not any(rope_patch.is_patched(m) for m in mods)
    done = rope_patch.apply_promptcache_rope()
    assert set(done) == {m.__name__ for m in mods}
    assert all(rope_patch.is_patched(m) for m in mods)
    assert rope_patch.apply_promptcache_rope() == done
    assert set(rope_patch.revert()) == set(done)
    assert [m.apply_rotary_pos_emb for m in mods] == originals


@pytest.mark.parametrize("family", rope_patch.FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_function_matches_hf(family, dtype):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    hf = mod.apply_rotary_pos_emb
    rope_patch.apply_promptcache_rope(module=family)
    fused = mod.apply_rotary_pos_emb
    assert fused is not hf
    q = torch.randn(2, 5, 4, 32).to(dtype).transpose(1, 2)
    k = torch.randn(2, 5, 2, 32).to(dtype).transpose(1, 2)
    ang = torch.tensor([0, 7, 3, 1000, 2])[:, None].float() * (1e4 ** (-torch.arange(0, 32, 2) / 32))
    emb = torch.cat((ang, ang), -1)[None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    for a, b in zip(fused(q, k, cos, sin), hf(q, k, cos, sin)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    for a, b in zip(fused(qt, kt, cos, sin, unsqueeze_dim=2), hf(qt, kt, cos, sin, unsqueeze_dim=2)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_uncovered_inputs_fall_back_to_hf():
    from transformers.models.llama import modeling_llama as ml

    hf = ml.apply_rotary_pos_emb
    rope_patch.apply_promptcache_rope(module="llama")
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    for a, b in zip(ml.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0), hf(q, k, cos, sin, unsqueeze_dim=0)):
        assert torch.equal(a, b)


def test_patches_an_already_built_model_and_logits_match(monkeypatch):
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 11))
    calls = []
    real = extras.apply_rotary_pos_emb
    monkeypatch.setattr(extras, "apply_rotary_pos_emb", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        base = model(ids).logits
        done = rope_patch.apply_promptcache_rope(model)
        assert done == ["transformers.models.llama.modeling_llama"]
        patched = model(ids).logits
        assert len(calls) == model.config.num_hidden_layers
        rope_patch.revert()
        again = model(ids).logits
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(patched, base, atol=1e-5, rtol=1e-5)
    assert torch.equal(again, base)
