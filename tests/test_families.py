"""Model families through the adapter interface: the engine oracle on a tiny random model per family.

Per family: cached == reference (fp32 first-logits max-abs <= 1e-3, identical greedy tokens) on prompts
with position gaps (a union member, an unimported nested module) and parameter slots; baseline differs
when modules are masked; the adapter with a plain causal spec reproduces the model's own forward (so
windows, ALiBi slopes and mask conventions match HF's); positions, not row order, drive attention.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from transformers import DynamicCache

from family_models import BY_NAME, FAMILIES, WINDOW
from pckernels import PMLError, UnsupportedModelError
from pckernels.engine import PromptCache
from pckernels.engine.plan import plan_request
from pckernels.integration.adapters import adapter_for, probe_kv_layout, supported_families
from pckernels.integration.attention import AttentionSpec, windowed_bias
from test_engine import PROMPTS, SCHEMA

FP32_TOL = 1e-3
NEW_TOKENS = 3
ORACLE_PROMPTS = ("nested-some", "everything")
"""Both leave position gaps (an unimported nested module; a union member without its sibling) and
fill parameter slots with arguments shorter than the slot (dead slot rows)."""

_caches: dict[tuple[str, bool], PromptCache] = {}


@contextlib.contextmanager
def hf_forward():
    """Engines built inside run HF's modules even where the native forward applies
    (``PROMPTCACHE_NATIVE=0``), so both paths stay tested."""
    saved = os.environ.get("PROMPTCACHE_NATIVE")
    os.environ["PROMPTCACHE_NATIVE"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PROMPTCACHE_NATIVE"]
        else:
            os.environ["PROMPTCACHE_NATIVE"] = saved


@pytest.fixture(scope="module")
def tokenizer():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


def prompt_cache(name: str, tokenizer, native: bool = True) -> PromptCache:
    """One PromptCache with the engine tests' schema per family (and forward: the native one where
    it applies, or HF's modules), built on first use."""
    if (name, native) not in _caches:
        with contextlib.nullcontext() if native else hf_forward():
            pc = PromptCache(BY_NAME[name].build(len(tokenizer)), tokenizer, placement="schema")
        pc.add_schema(SCHEMA)
        _caches[name, native] = pc
    return _caches[name, native]


def causal_spec(positions: torch.Tensor, dtype=torch.float32) -> AttentionSpec:
    bias = torch.zeros(len(positions), len(positions), dtype=dtype)
    bias.masked_fill_(positions[None, :] > positions[:, None], float("-inf"))
    return AttentionSpec(bias, positions, positions)


def run_adapter(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """All-token logits ``[n, vocab]`` of ``ids [1, n]`` at ``positions [n]`` through the adapter."""
    adapter = adapter_for(model)
    with torch.inference_mode():
        return adapter.forward(ids, positions[None], causal_spec(positions), DynamicCache(config=model.config),
                               last_logits_only=False)


FAMILY_NAMES = [f.name for f in FAMILIES]


@pytest.mark.parametrize("prompt", ORACLE_PROMPTS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_cached_matches_reference(tokenizer, family, prompt):
    pc = prompt_cache(family, tokenizer)
    ref = pc.generate(PROMPTS[prompt], mode="reference", max_new_tokens=NEW_TOKENS)
    got = pc.generate(PROMPTS[prompt], mode="cached", max_new_tokens=NEW_TOKENS)
    assert got.positions == ref.positions
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids


def test_oracle_prompts_have_gaps_and_slots(tokenizer):
    pc = prompt_cache("llama", tokenizer)
    for prompt in ("nested-some", "everything"):
        positions = pc.resolve(PROMPTS[prompt]).position_ids
        assert list(positions) != list(range(positions[0], positions[0] + len(positions)))
        resolved = pc.resolve(PROMPTS[prompt])
        plan = plan_request(resolved)
        hidden = [ref for ref in plan.blocks if ref.hidden]
        assert hidden, "parameter slots are hidden in their blocks"
        slots = {p for ref in hidden for i in ref.hidden
                 for p in [resolved.schema.modules[ref.module].position_ids[i]]}
        assert set(plan.new_positions) & slots, "arguments are computed at their slots' positions"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_masking_is_in_effect(tokenizer, family):
    pc = prompt_cache(family, tokenizer)
    base = pc.generate(PROMPTS["everything"], mode="baseline", max_new_tokens=1)
    got = pc.generate(PROMPTS["everything"], mode="cached", max_new_tokens=1)
    assert base.prompt_token_ids == got.prompt_token_ids
    assert (base.first_logits - got.first_logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_adapter_reproduces_the_model_on_a_causal_prompt(tokenizer, family):
    """Contiguous positions and a causal spec through the adapter == the model's own forward, over
    more tokens than any window: windows, ALiBi and mask conventions agree with HF's."""
    model = prompt_cache(family, tokenizer).model
    ids = torch.randint(0, len(tokenizer), (1, 3 * (BY_NAME[family].window or WINDOW)), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(input_ids=ids).logits[0]
    got = run_adapter(model, ids, torch.arange(ids.shape[1]))
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_attention_follows_positions_not_rows(tokenizer, family):
    """The same tokens with a position gap give other logits; shifted as a whole they give the same
    (relative schemes: RoPE, ALiBi) — positions, not sequence order, reach attention."""
    model = prompt_cache(family, tokenizer).model
    n = 2 * WINDOW
    ids = torch.randint(0, len(tokenizer), (1, n), generator=torch.Generator().manual_seed(2))
    plain = run_adapter(model, ids, torch.arange(n))
    gapped = run_adapter(model, ids, torch.cat([torch.arange(n // 2), torch.arange(n // 2) + n]))
    assert (plain - gapped).abs().max().item() > 1e-2
    if BY_NAME[family].relative:
        shifted = run_adapter(model, ids, torch.arange(n) + 37)
        assert (plain - shifted).abs().max().item() <= 1e-3


@pytest.mark.parametrize("family", [f.name for f in FAMILIES if f.window])
def test_window_is_by_position(tokenizer, family):
    """Sliding layers see a key only while ``query_pos - key_pos < window``, with gaps counted."""
    adapter = prompt_cache(family, tokenizer).adapter
    window = BY_NAME[family].window
    positions = torch.cat([torch.arange(5), torch.arange(5) + window - 2])
    spec = causal_spec(positions)
    mask = adapter.attention_mask(spec)
    masks = mask.values() if isinstance(mask, dict) else [mask]
    windowed = [m for m in masks if not torch.equal(m[0, 0], spec.bias)]
    assert len(windowed) == 1
    visible = torch.isfinite(windowed[0][0, 0])
    distance = positions[:, None] - positions[None, :]
    assert torch.equal(visible, (distance >= 0) & (distance < window))
    assert torch.equal(windowed_bias(spec, None), spec.bias)


def test_gemma3_module_longer_than_window(tokenizer):
    pc = prompt_cache("gemma3", tokenizer)
    schema = pc.schemas["guide"]
    assert max(len(m.token_ids) for m in schema.modules.values()) > 2 * WINDOW
    assert not any(pc.scheduler.runner.cache.is_sliding)
    windows = pc.adapter.attention_mask(causal_spec(torch.arange(3)))
    assert set(windows) == {"sliding_attention", "full_attention"}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_kv_layout_matches_what_the_model_caches(tokenizer, family):
    """The probed layout is what the installed transformers caches in every layer (Falcon's
    new decoder architecture cached expanded heads up to 5.24 and grouped ones from 5.25)."""
    pc = prompt_cache(family.name, tokenizer)
    cache = DynamicCache(config=pc.model.config)
    with torch.inference_mode():
        pc.adapter.forward(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], None, cache)
    layout = pc.adapter.kv_layout()
    cached = [layer for layer in cache.layers if layer.keys is not None and layer.keys.numel()]
    assert layout.num_layers == len(cached) == pc.model.config.num_hidden_layers
    for layer in cached:
        assert layer.keys.shape == (1, layout.num_kv_heads, 3, layout.head_dim), family.name
        assert layer.values.shape == layer.keys.shape
    assert pc.scheduler.arena.data.shape[:3] == (layout.num_layers, 2, layout.num_kv_heads)


def test_kv_probe_reads_the_model_not_its_config(tokenizer):
    """A config that misstates the KV heads cannot mislead the probe: it reads what the layers cache."""
    model = BY_NAME["llama"].build(len(tokenizer))
    adapter = adapter_for(model)
    model.config.num_key_value_heads = 6
    model.config.head_dim = 4
    layout, layers = probe_kv_layout(adapter)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 8)
    assert layers == (0, 1)


def test_kv_probe_finds_the_attention_layers_of_a_hybrid(tokenizer):
    """Recurrent layers keep no KV: the probe names the attention layers, and the engine refuses
    the model for modular reuse with a message pointing at exact prefix reuse."""
    from pckernels.integration.adapters import ModelAdapter
    from pckernels.prefix.testing import tiny_model

    model = tiny_model("lfm2", len(tokenizer))
    adapter = ModelAdapter(model)
    layout, layers = probe_kv_layout(adapter)
    assert layers == (1, 3)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    with pytest.raises(UnsupportedModelError, match=r"only in layers \[1, 3\].*complete"):
        adapter.kv_layout()


def test_kv_probe_refuses_keys_and_values_of_different_shapes(tokenizer):
    """Multi-head latent attention (transformers 5.25) caches its latent and its rotated keys as the
    pair: of different widths here, which the buffer cannot hold."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from pckernels.integration.adapters import ModelAdapter

    config = DeepseekV3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                              moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=2, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
                              topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=12,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    model = DeepseekV3ForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="keys .* and values"):
        probe_kv_layout(ModelAdapter(model))


def test_gpt2_schema_must_fit_n_positions(tokenizer):
    small = BY_NAME["gpt2"].build(len(tokenizer))
    small.config.n_positions = 64
    pc = PromptCache(small, tokenizer, placement="schema")
    assert pc.adapter.max_positions() == 64
    with pytest.raises(PMLError, match="64"):
        pc.add_schema(SCHEMA)


def test_unsupported_family_names_the_supported_ones(tokenizer):
    from transformers import RwkvConfig, RwkvForCausalLM

    model = RwkvForCausalLM(RwkvConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16,
                                       intermediate_size=32, context_length=64))
    with pytest.raises(UnsupportedModelError) as err:
        PromptCache(model, tokenizer, placement="schema")
    for family in ("llama", "gemma3_text", "falcon", "mpt", "bloom", "gpt2"):
        assert family in str(err.value)
        assert family in supported_families()


def test_longrope_is_limited_to_its_original_length(tokenizer):
    """Longrope switches every frequency once a forward's largest position passes the original
    length, so blocks encoded below it would not match: the adapter stops there."""
    from family_models import Family

    rope = dict(rope_type="longrope", rope_theta=10000.0, long_factor=[2.0] * 4, short_factor=[1.0] * 4,
                original_max_position_embeddings=64)
    family = Family("phi3-longrope", "Phi3Config", dict(BY_NAME["phi3"].kwargs, rope_parameters=rope,
                                                        original_max_position_embeddings=64))
    assert adapter_for(family.build(len(tokenizer))).max_positions() == 64
    assert prompt_cache("llama-dynamic", tokenizer).adapter.max_positions() == 2048


def test_grouped_kv_on_cpu_is_used_and_changes_nothing(tokenizer, monkeypatch):
    """A masked CPU forward hands grouped KV heads to SDPA (``enable_gqa``) instead of expanding
    them; the logits are bitwise those of the expanded path."""
    model = prompt_cache("llama", tokenizer).model
    adapter = adapter_for(model)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.tensor([[5, 17, 2, 99, 41, 7, 300]])
    positions = torch.tensor([0, 1, 2, 9, 10, 11, 12])
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, *args, **kwargs):
        calls.append((query.shape[1] == key.shape[1], kwargs.get("enable_gqa", False)))
        return original(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    def run():
        with torch.inference_mode():
            return adapter.forward(ids, positions[None], causal_spec(positions), DynamicCache(config=model.config),
                                   last_logits_only=False)

    grouped = run()
    assert calls and all(gqa and not same_heads for same_heads, gqa in calls)
    calls.clear()
    adapter.grouped_kv = False
    expanded = run()
    assert calls and all(same_heads and not gqa for same_heads, gqa in calls)
    assert torch.equal(grouped, expanded)
