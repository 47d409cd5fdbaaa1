"""The native forward (``pckernels.integration.native``) against HF's modules.

Per recognised family: the same logits as the adapter's HF path over the same KV buffer, for a
prefill at discontinuous positions, a one-token step and a long forward (the SDPA path), with
masked rows poisoned; keys and values written to the same rows. Engines built on the native
forward meet the oracle (cached == reference) as every family does in ``test_families``. The
HF modules keep computing what they computed (their weights became views into fused tensors).
A wrong native forward fails its self-check and the adapter falls back to HF's modules. The
bf16 matmul option stays close to fp32, is keyed apart, and is refused where it cannot run.
All of the engine's model work runs on its scheduler thread.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from transformers import DynamicCache

from family_models import BY_NAME, FAMILIES
from pckernels.engine import PromptCache
from pckernels.engine.buffer import AssemblyBuffer, BufferCache
from pckernels.integration import native as native_mod
from pckernels.integration.adapters import adapter_for
from pckernels.integration.attention import AttentionSpec
from pckernels.integration.native import NativeDecoder, bf16_matmul_supported
from test_engine import PROMPTS, SCHEMA
from test_families import FP32_TOL, hf_forward, prompt_cache, tokenizer  # noqa: F401  (fixture)

NATIVE = {"llama", "llama-linear", "llama-yarn", "llama3", "mistral", "qwen2", "qwen3"}
"""Families the native forward recognises (dynamic NTK RoPE recomputes frequencies per forward)."""
NATIVE_TOL = 1e-4


def twins(name: str, vocab: int):
    """The same tiny model twice: one driven natively, one through HF's modules."""
    native = adapter_for(BY_NAME[name].build(vocab))
    with hf_forward():
        hf = adapter_for(BY_NAME[name].build(vocab))
    assert hf.native is None
    return native, hf


def buffer_for(adapter, capacity: int) -> BufferCache:
    layout = adapter.kv_layout()
    buf = AssemblyBuffer(layout, dtype=torch.float32, device="cpu", capacity=capacity)
    buf.data.fill_(float("nan"))
    return BufferCache(buf)


def run(adapter, cache: BufferCache, ids, positions, bias, rows, extent) -> torch.Tensor:
    """All-row logits of one forward writing ``rows`` and reading rows ``0 .. extent - 1``."""
    cache.prepare(rows=torch.tensor(rows), start=0, extent=extent)
    key_pos = cache.buffer.row_pos[:extent]
    spec = AttentionSpec(bias, torch.tensor(positions), key_pos)
    with torch.inference_mode():
        return adapter.forward(torch.tensor([ids]), torch.tensor([positions]), spec, cache, last_logits_only=False)


def scenario(vocab: int, long: int = 70):
    """Three forwards into a 120-row buffer: a prefill of 9 tokens at gapped positions written to
    scattered rows (row 3 is a masked 'dead' row poisoned with 1e3), one decode token, then a long
    forward of ``long`` tokens (past ``SMALL_QUERY``: SDPA in query chunks)."""
    g = torch.Generator().manual_seed(7)
    steps = []
    pre_rows = [0, 1, 2, 4, 5, 6, 9, 10, 11]
    pre_pos = [0, 1, 2, 3, 4, 9, 10, 11, 12]
    steps.append((pre_rows, pre_pos))
    steps.append(([12], [13]))
    steps.append((list(range(13, 13 + long)), list(range(14, 14 + long))))
    out = []
    for rows, pos in steps:
        ids = torch.randint(5, vocab, (len(rows),), generator=g).tolist()
        out.append((ids, rows, pos))
    return out


def run_scenario(adapter, vocab: int, long: int = 70) -> tuple[list[torch.Tensor], torch.Tensor]:
    cache = buffer_for(adapter, 120)
    buf = cache.buffer
    buf.data[:, :, :, 3].fill_(1e3)
    buf.data[:, :, :, 7:9].fill_(1e3)
    written: list[int] = []
    logits = []
    for ids, rows, pos in scenario(vocab, long):
        buf.row_pos[torch.tensor(rows)] = torch.tensor(pos)
        written += rows
        extent = max(written) + 1
        live = torch.zeros(extent, dtype=torch.bool)
        live[torch.tensor(written)] = True
        key_pos = buf.row_pos[:extent]
        visible = live[None, :] & (key_pos[None, :] <= torch.tensor(pos)[:, None])
        bias = torch.zeros(len(pos), extent).masked_fill_(~visible, float("-inf"))
        logits.append(run(adapter, cache, ids, pos, bias, rows, extent))
    return logits, buf.data[:, :, :, torch.tensor(written)].clone()


def test_native_applies_to_the_recognised_families(tokenizer):  # noqa: F811
    for family in FAMILIES:
        adapter = adapter_for(family.build(len(tokenizer)))
        assert (adapter.native is not None) == (family.name in NATIVE), family.name


@pytest.mark.parametrize("family", sorted(NATIVE))
def test_native_forward_matches_hf_over_the_same_buffer(tokenizer, family):  # noqa: F811
    native, hf = twins(family, len(tokenizer))
    assert native.native is not None
    got, got_kv = run_scenario(native, len(tokenizer))
    want, want_kv = run_scenario(hf, len(tokenizer))
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert (a - b).abs().max().item() <= NATIVE_TOL * max(1.0, b.abs().max().item())
    assert (got_kv - want_kv).abs().max().item() <= NATIVE_TOL * max(1.0, want_kv.abs().max().item())


def test_per_head_batched_and_sdpa_paths_agree(tokenizer, monkeypatch):  # noqa: F811
    native, _ = twins("qwen2", len(tokenizer))
    per_head, _ = run_scenario(native, len(tokenizer), long=30)
    monkeypatch.setattr(native_mod, "PER_HEAD_MAX", 0)
    batched, _ = run_scenario(native, len(tokenizer), long=30)
    monkeypatch.setattr(native_mod, "SMALL_QUERY", 0)
    monkeypatch.setattr(native_mod, "QUERY_CHUNK", 7)
    chunked, _ = run_scenario(native, len(tokenizer), long=30)
    for a, b, c in zip(per_head, batched, chunked):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
        assert (a - c).abs().max().item() <= 1e-5 * max(1.0, c.abs().max().item())


@pytest.mark.parametrize("cpu_path", native_mod.CPU_PATHS)
def test_hf_forward_of_the_model_is_unchanged(tokenizer, monkeypatch, cpu_path):  # noqa: F811
    """The fused weights are shared with the HF modules: their own forward is bitwise the twin's on
    the ``linear`` path; on ``transposed`` (the modules' weights are views of ``[in, out]`` tensors)
    equal to rounding."""
    monkeypatch.setenv(native_mod.CPU_PATH_ENV, cpu_path)
    native, hf = twins("qwen2", len(tokenizer))
    assert native.native.cpu_path == cpu_path
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        a = native.model(input_ids=ids, cache=DynamicCache(config=native.model.config)).logits
        b = hf.model(input_ids=ids, cache=DynamicCache(config=hf.model.config)).logits
    if native.native.modules_as_loaded():  # linear, per-row (its head copy is the native forward's own)
        assert torch.equal(a, b)
    else:
        assert (a - b).abs().max().item() <= NATIVE_TOL * max(1.0, b.abs().max().item())
    layer = native.model.model.layers[0]
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == \
        layer.self_attn.q_proj.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_native_engines_meet_the_oracle(tokenizer, family):  # noqa: F811
    pc = prompt_cache(family, tokenizer)
    assert pc.adapter.native is not None and pc.numerics == "cpu/native-fp32"
    hf = prompt_cache(family, tokenizer, native=False)
    assert hf.numerics == "cpu"
    for name in ("nested-some", "everything"):
        cached = pc.generate(PROMPTS[name], max_new_tokens=4)
        reference = pc.generate(PROMPTS[name], max_new_tokens=4, mode="reference")
        via_hf = hf.generate(PROMPTS[name], max_new_tokens=4)
        assert (cached.first_logits - reference.first_logits).abs().max().item() <= FP32_TOL
        assert cached.token_ids == reference.token_ids == via_hf.token_ids
        assert (cached.first_logits - via_hf.first_logits).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("cpu_bf16", [True, False], ids=["cpu-with-bf16", "cpu-without-bf16"])
def test_a_wrong_native_forward_falls_back_to_hf(tokenizer, monkeypatch, caplog, cpu_bf16):  # noqa: F811
    """fp32: a native forward failing its self-check logs "disagrees" and HF's modules run. bf16
    (which only the native forward gives): an error, never a silent fallback — the disagreement on
    a CPU with native bf16, the CPU's refusal, checked first, on one without. The package's probe
    plays both CPUs on every machine (the disagreement raises before any bf16 matmul runs)."""
    monkeypatch.setattr(native_mod, "bf16_matmul_supported", lambda: cpu_bf16)
    original = NativeDecoder._rope

    def mirrored(self, positions, dtype):
        cos, sin = original(self, positions, dtype)
        return cos, -sin

    monkeypatch.setattr(NativeDecoder, "_rope", mirrored)
    with caplog.at_level(logging.WARNING):
        adapter = adapter_for(BY_NAME["llama"].build(len(tokenizer)))
    assert adapter.native is None
    assert "disagrees" in caplog.text
    refusal = "disagrees" if cpu_bf16 else "no native bf16 matmul"
    with pytest.raises(ValueError, match=refusal):
        adapter_for(BY_NAME["llama"].build(len(tokenizer)), matmul="bf16")


def test_bf16_matmul_is_refused_where_it_cannot_run(tokenizer):  # noqa: F811
    with pytest.raises(ValueError, match="native forward"):
        PromptCache(BY_NAME["gpt2"].build(len(tokenizer)), tokenizer, matmul="bf16", placement="schema")
    with pytest.raises(ValueError, match="matmul must be one of"):
        PromptCache(BY_NAME["llama"].build(len(tokenizer)), tokenizer, matmul="int3", placement="schema")


@pytest.mark.skipif(not bf16_matmul_supported(), reason="no native bf16 matmul on this CPU")
def test_bf16_matmul_stays_close_and_is_keyed_apart(tokenizer):  # noqa: F811
    fp32 = prompt_cache("llama", tokenizer)
    pc = PromptCache(BY_NAME["llama"].build(len(tokenizer)), tokenizer, matmul="bf16", placement="schema")
    pc.add_schema(SCHEMA)
    assert pc.numerics == "cpu/native-bf16"
    key = pc.block_key(pc.schemas["guide"], "paris")
    assert key.digest != fp32.block_key(fp32.schemas["guide"], "paris").digest
    for name in ("nested-some", "everything"):
        cached = pc.generate(PROMPTS[name], max_new_tokens=1)
        reference = pc.generate(PROMPTS[name], max_new_tokens=1, mode="reference")
        exact = fp32.generate(PROMPTS[name], max_new_tokens=1)
        spread = exact.first_logits.abs().max().item()
        assert (cached.first_logits - reference.first_logits).abs().max().item() <= 0.05 * spread
        assert (cached.first_logits - exact.first_logits).abs().max().item() <= 0.1 * spread
        assert (cached.first_logits - exact.first_logits).abs().max().item() > 0


def test_model_work_runs_on_the_scheduler_thread(tokenizer, monkeypatch):  # noqa: F811
    """Encoding, answering and deviation scoring all run forwards on one thread (OpenMP teams
    per thread make a second one slow: ``pckernels.engine.threads``)."""
    pc = PromptCache(BY_NAME["llama"].build(len(tokenizer)), tokenizer, placement="schema")
    seen = set()
    layer = pc.adapter.native.layers[0]
    original = layer.o

    def spy(x):
        seen.add(threading.current_thread().name)
        return original(x)

    def hook(module, args):  # every nn.Module call: HF forwards, the compact placement's probe
        seen.add(threading.current_thread().name)

    monkeypatch.setattr(layer, "o", spy)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        pc.add_schema(SCHEMA)
        pc.generate(PROMPTS["everything"], max_new_tokens=2)
        pc.generate(PROMPTS["everything"], max_new_tokens=1, recompute=0.5, recompute_policy="deviation")
        compact = PROMPTS["nested-some"].replace("<prompt ", '<prompt placement="compact" ', 1)
        pc.generate(compact, max_new_tokens=2, recompute=2, recompute_policy="epic")
        pc.complete("A plain prompt without modules.", max_new_tokens=2)
        pc.prefix.complete("Another plain prompt, through the prefix cache itself.", max_new_tokens=2)
    finally:
        handle.remove()
    assert seen == {"promptcache-scheduler"}
    assert pc.scheduler.counters["blocks_moved"] > 0


def test_scheduler_calls_return_raise_and_run_inline_under_the_lock(tokenizer):  # noqa: F811
    pc = PromptCache(BY_NAME["llama"].build(len(tokenizer)), tokenizer, placement="schema")
    assert pc.scheduler.call(lambda: threading.current_thread().name) == "promptcache-scheduler"
    with pytest.raises(KeyError):
        pc.scheduler.call(lambda: {}["missing"])
    with pc.model_lock:
        assert pc.scheduler.call(lambda: threading.current_thread().name) == threading.current_thread().name
    pc.close()
    with pytest.raises(RuntimeError, match="closed"):
        pc.scheduler.call(lambda: 1)
