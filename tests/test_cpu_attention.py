"""Query-chunked masked attention on CPU: each run of query rows attends only up to the last key
it may see; outputs must match the single masked SDPA call for every family."""

from __future__ import annotations

import pytest
import torch

from family_models import FAMILIES
from pckernels.integration import attention
from pckernels.integration.attention import visible_extents
from test_engine import PROMPTS
from test_families import FP32_TOL, prompt_cache, tokenizer  # noqa: F401  (fixture)

NEG_INF = float("-inf")


def extents_reference(mask: torch.Tensor, chunk: int) -> list[int]:
    """Plain loop: per run of ``chunk`` rows, one past the last column any row sees (or ``kv``)."""
    visible = (mask != NEG_INF).any(dim=1).any(dim=0)
    rows, keys = visible.shape
    out = []
    for first in range(0, rows, chunk):
        columns = [j for j in range(keys) if bool(visible[first:first + chunk, j].any())]
        out.append(columns[-1] + 1 if columns else keys)
    return out


@pytest.mark.parametrize("rows,keys,chunk", [(1, 1, 1), (7, 19, 3), (13, 13, 4), (5, 40, 8), (33, 70, 32)])
def test_visible_extents_match_a_plain_loop(rows, keys, chunk):
    generator = torch.Generator().manual_seed(rows * 100 + keys)
    for heads in (1, 3):
        bias = torch.randn(1, heads, rows, keys, generator=generator)
        bias[torch.rand(bias.shape, generator=generator) < 0.6] = NEG_INF
        if rows > 2:
            bias[:, :, 1] = NEG_INF
        assert visible_extents(bias, chunk) == extents_reference(bias, chunk)


def test_visible_extents_of_a_cached_prefix_then_causal_text():
    """Three cached rows every query sees, then causal new rows: run i sees up to its own last row."""
    new, cached = 10, 3
    bias = torch.zeros(new, cached + new)
    bias[:, cached:] = torch.full((new, new), NEG_INF).triu(1)
    assert visible_extents(bias[None, None], 4) == [cached + 4, cached + 8, cached + 10]


def long_prompt() -> str:
    """The engine tests' schema with a user turn long enough to span several query runs."""
    question = " ".join(f"word{i}" for i in range(40))
    return PROMPTS["everything"].replace("<assistant/>", f"<user>{question}</user><assistant/>")


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_chunked_masked_forward_matches_one_call(tokenizer, family, monkeypatch):  # noqa: F811
    pc = prompt_cache(family, tokenizer, native=False)
    prompt = long_prompt()
    whole = {}
    with monkeypatch.context() as patch:
        patch.setattr(pc.adapter, "query_chunk", None)
        for mode in ("cached", "reference"):
            whole[mode] = pc.generate(prompt, mode=mode, max_new_tokens=3)
    monkeypatch.setattr(pc.adapter, "query_chunk", 5)
    for mode in ("cached", "reference"):
        got = pc.generate(prompt, mode=mode, max_new_tokens=3)
        assert got.computed_tokens > 10
        assert (got.first_logits - whole[mode].first_logits).abs().max().item() <= FP32_TOL
        assert got.token_ids == whole[mode].token_ids


def test_chunked_path_is_taken_and_cuts_keys(tokenizer, monkeypatch):  # noqa: F811
    """On an SDPA model the long forward is split into runs of at most ``query_chunk`` queries,
    the earlier runs over fewer keys than the whole forward."""
    pc = prompt_cache("llama", tokenizer, native=False)
    assert pc.model.config._attn_implementation == attention.ATTENTION
    shapes = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, *args, **kwargs):
        shapes.append((query.shape[-2], key.shape[-2]))
        return original(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(pc.adapter, "query_chunk", 5)
    result = pc.generate(long_prompt(), max_new_tokens=1)
    layers = pc.model.config.num_hidden_layers
    runs = -(-result.computed_tokens // 5)
    prefill = shapes[:runs * layers]
    assert all(q <= 5 for q, _ in prefill)
    assert sum(q for q, _ in prefill) == result.computed_tokens * layers
    assert min(k for _, k in prefill) < max(k for _, k in prefill)
