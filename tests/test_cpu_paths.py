"""The native forward's fp32 CPU paths (``pckernels.integration.native.CPU_PATHS``).

No test assumes the host's ISA: the load-time rule is tested with the capability faked, every
path is forced and checked on any host, and the measured plan's choice is tested on given timings
(both branches) and applied by force. Tolerances: each path is deterministic (bitwise equal
run to run); against HF's forward and against each other the paths agree to fp32 rounding —
``NATIVE_TOL`` (1e-4 of the logits' largest magnitude) on the tiny families, and on the embedded
SmolLM2 first logits within ``EMBEDDED_TOL`` (1e-4 of their spread) of HF's forward and greedy
tokens equal over 32 on every path.
"""

from __future__ import annotations

import pytest
import torch

from family_models import BY_NAME
from pckernels.integration import native as native_mod
from pckernels.integration.adapters import adapter_for
from pckernels.integration.native import (CPU_PATH_ENV, CPU_PATHS, PATH_PLANS, ROW_CLASSES, NativeDecoder,
                                          choose_plan, default_cpu_path)
from test_families import tokenizer  # noqa: F401  (fixture)
from test_native import NATIVE_TOL, buffer_for, run, run_scenario, twins

EMBEDDED_TOL = 1e-4
"""Largest |path - HF| of the embedded model's fp32 logits, relative to their spread."""


@pytest.mark.parametrize("capability, path", [("AVX2", "per-row"), ("AVX512", "linear"),
                                              ("DEFAULT", "linear"), ("ZVECTOR", "linear")])
def test_the_load_time_rule_follows_the_capability(monkeypatch, capability, path):
    monkeypatch.delenv(CPU_PATH_ENV, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert default_cpu_path() == path


def test_the_setting_forces_a_path_and_refuses_others(monkeypatch):
    for path in CPU_PATHS:
        monkeypatch.setenv(CPU_PATH_ENV, path)
        assert default_cpu_path() == path
    monkeypatch.setenv(CPU_PATH_ENV, "fastest")
    with pytest.raises(ValueError, match=CPU_PATH_ENV):
        default_cpu_path()


def _forced(monkeypatch, path: str, family: str, vocab: int):
    monkeypatch.setenv(CPU_PATH_ENV, path)
    native, hf = twins(family, vocab)
    assert native.native is not None and native.native.cpu_path == path
    return native, hf


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: projection biases
def test_each_path_matches_hf_and_is_deterministic(tokenizer, monkeypatch, path, family):  # noqa: F811
    native, hf = _forced(monkeypatch, path, family, len(tokenizer))
    got, got_kv = run_scenario(native, len(tokenizer))
    again, again_kv = run_scenario(native, len(tokenizer))
    want, want_kv = run_scenario(hf, len(tokenizer))
    for a, b, c in zip(got, again, want):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
        assert (a - c).abs().max().item() <= NATIVE_TOL * max(1.0, c.abs().max().item())
    assert torch.equal(got_kv, again_kv)
    assert (got_kv - want_kv).abs().max().item() <= NATIVE_TOL * max(1.0, want_kv.abs().max().item())


def test_switching_paths_keeps_the_weights_shared_and_comes_back_bitwise(tokenizer, monkeypatch):  # noqa: F811
    native, _ = _forced(monkeypatch, "linear", "qwen2", len(tokenizer))
    decoder = native.native
    before, before_kv = run_scenario(native, len(tokenizer))
    layer = native.model.model.layers[0]
    decoder.set_cpu_path("transposed")
    qkv = decoder.layers[0].qkv
    assert qkv.weight_t is not None and qkv.weight_t.is_contiguous()
    for module in (layer.self_attn.q_proj, layer.self_attn.v_proj):  # views, no copy
        assert module.weight.untyped_storage().data_ptr() == qkv.weight_t.untyped_storage().data_ptr()
    transposed, _ = run_scenario(native, len(tokenizer))
    for a, b in zip(before, transposed):
        assert (a - b).abs().max().item() <= NATIVE_TOL * max(1.0, b.abs().max().item())
    decoder.set_cpu_path("linear")
    assert decoder.layers[0].qkv.weight_t is None and layer.self_attn.q_proj.weight.is_contiguous()
    after, after_kv = run_scenario(native, len(tokenizer))
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    assert torch.equal(before_kv, after_kv)
    with pytest.raises(ValueError, match="cpu_path"):
        decoder.set_cpu_path("fastest")


def test_build_takes_the_path_and_logs_it(tokenizer, monkeypatch, caplog):  # noqa: F811
    import logging

    model = BY_NAME["llama"].build(len(tokenizer))
    with caplog.at_level(logging.INFO, logger=native_mod.__name__):
        decoder = NativeDecoder.build(model, [None] * model.config.num_hidden_layers, cpu_path="transposed")
    assert decoder.cpu_path == "transposed" and "CPU path 'transposed'" in caplog.text
    with pytest.raises(ValueError, match="cpu_path"):
        NativeDecoder.build(model, [None] * model.config.num_hidden_layers, cpu_path="fastest")


@pytest.fixture
def one_thread():
    """The slow test's forwards on one thread: on a shared 2-core machine two threads of each wait
    on each other's scheduling (the figures do not matter here, only the tokens)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_embedded_model_greedy_tokens_and_logits_on_every_path(one_thread):
    """SmolLM2 fp32: 32 greedy tokens equal on every path; first logits within ``EMBEDDED_TOL`` of
    HF's forward (relative to their spread); each path bitwise equal run to run."""
    from pckernels.engine import PromptCache

    pc = PromptCache.from_pretrained("smollm2", device="cpu", dtype="float32", store_dir=False)
    decoder = pc.adapter.native
    assert decoder is not None
    ids = list(pc.tokenizer("The harbour master records the tide height at noon, and ships").input_ids)
    with torch.inference_mode():
        hf_logits = pc.adapter.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    spread = float(hf_logits.std())
    tokens = {}
    for path in CPU_PATHS:
        decoder.set_cpu_path(path)
        first = pc.complete(ids, max_new_tokens=32, reuse=False)
        again = pc.complete(ids, max_new_tokens=1, reuse=False)
        assert torch.equal(first.first_logits, again.first_logits)
        assert (first.first_logits - hf_logits).abs().max().item() <= EMBEDDED_TOL * spread, path
        tokens[path] = first.token_ids
    assert len(tokens["linear"]) == 32 and len({tuple(t) for t in tokens.values()}) == 1, tokens


def test_perf_records_the_isa_and_compares_the_paths_on_a_tiny_model(monkeypatch):
    """``cpu_isa`` (beside every CPU figure), ``perf.profile_cpu`` and ``perf.bench_cpu_paths`` on
    a tiny random Llama; no timing assertions."""
    from perf import bench_cpu_paths, gpu_suite, profile_cpu
    from perf.suite.runner import cpu_isa
    from test_perf_suite import TINY_SHAPE

    monkeypatch.delenv(CPU_PATH_ENV, raising=False)
    isa = cpu_isa()
    assert isa["capability"] == torch.backends.cpu.get_cpu_capability()
    assert isa["native_cpu_path"] == default_cpu_path() and isinstance(isa["bf16_matmul"], bool)
    assert ("no AVX-512" in isa["summary"]) != isa["avx512"] and isa["capability"] in isa["summary"]
    torch.manual_seed(0)
    model = gpu_suite.random_llama(TINY_SHAPE, "cpu", torch.float32)
    decoder = NativeDecoder.build(model, [None] * model.config.num_hidden_layers, cpu_path="linear")
    part = profile_cpu.profile(decoder, 37, 3, steps=1)
    assert len(part["per_layer_ms"]) == len(decoder.layers) and part["total_ms"] > 0 and part["ops"]
    rounds = bench_cpu_paths.forward_rounds(decoder, list(CPU_PATHS), 37, repeats=2, steps=1)
    assert set(rounds) == {"decode step ms", "prefill 10 ms", "8 rows over 512 ms"}
    assert all(len(per[path]) == 2 for per in rounds.values() for path in CPU_PATHS)
    assert len(bench_cpu_paths.table(rounds, list(CPU_PATHS))) == 5


def test_per_row_keeps_the_modules_and_copies_only_the_head(tokenizer, monkeypatch):  # noqa: F811
    """``per-row``: every layer ``[out, in]`` as loaded, the (tied) head a transposed copy used for
    one to three rows only, the memory it costs reported."""
    native, _ = _forced(monkeypatch, "per-row", "llama", len(tokenizer))
    decoder = native.native
    head = decoder.lm_head
    assert decoder.modules_as_loaded() and head.layout == "both"
    assert all(p.layout == "out_in" for p in decoder.projections()[:-1])
    assert head.weight.is_contiguous() and head.weight_t.is_contiguous()
    assert decoder.extra_bytes() == head.weight.numel() * head.weight.element_size()
    assert head.plan == PATH_PLANS["per-row"][1] and decoder.plans()["qkv"] == PATH_PLANS["linear"][0]
    x = torch.randn(50, head.weight.shape[1])  # 50 rows: "many"
    with torch.inference_mode():
        assert torch.equal(head(x[:1]), torch.mm(x[:1], head.weight_t))
        assert torch.equal(head(x[:3]), torch.mm(x[:3], head.weight_t))
        assert torch.equal(head(x[:8]), head.run(x[:8], "onednn"))
        assert torch.equal(head(x), head.run(x, "linear"))
    decoder.set_cpu_path("linear")
    assert head.layout == "out_in" and decoder.extra_bytes() == 0


def test_choose_plan_follows_the_timings():
    """Both branches of the measured choice, on given times (s per kind)."""
    mm_wins = {"one": {"linear": 1.0, "onednn": 1.2, "mm_t": 0.7}, "few": {"linear": 1.0, "onednn": 0.9, "mm_t": 0.95}}
    assert choose_plan(mm_wins, head=False) == {c: "mm_t" for c in ROW_CLASSES}
    assert choose_plan(mm_wins, head=True) == {"one": "mm_t", "few": "onednn", "many": "linear"}
    mm_loses = {"one": {"linear": 1.0, "onednn": 0.9, "mm_t": 0.97}, "few": {"linear": 1.0, "onednn": 1.1, "mm_t": 1.3}}
    assert choose_plan(mm_loses, head=False) == {"one": "onednn", "few": "linear", "many": "linear"}
    assert choose_plan(mm_loses, head=True) == {"one": "onednn", "few": "linear", "many": "linear"}
    within_margin = {"one": {"linear": 1.0, "mm_t": 0.97}, "few": {"linear": 1.0, "mm_t": 0.96}}
    assert choose_plan(within_margin, head=False) == PATH_PLANS["linear"][0] | {"few": "linear"}
    assert choose_plan(within_margin, head=True) == {c: "linear" for c in ROW_CLASSES}


@pytest.mark.parametrize("layers", ["mm_t", "linear"])
def test_a_measured_plan_is_applied_and_matches_hf(tokenizer, monkeypatch, layers):  # noqa: F811
    """``measured`` with the timing replaced by a given plan (layers moved to ``[in, out]`` or kept):
    layouts follow it, and the forward meets HF's to rounding, bitwise run to run."""
    native, hf = _forced(monkeypatch, "linear", "qwen2", len(tokenizer))
    decoder = native.native
    layer_plan = {c: layers for c in ROW_CLASSES}
    decoder.set_cpu_path("measured", measure=lambda d: {k: PATH_PLANS["per-row"][1] if k == "lm_head" else layer_plan
                                                        for k in d.kinds()})
    assert decoder.cpu_path == "measured" and decoder.plans()["down"] == layer_plan
    assert decoder.modules_as_loaded() == (layers == "linear")
    got, got_kv = run_scenario(native, len(tokenizer))
    again, _ = run_scenario(native, len(tokenizer))
    want, want_kv = run_scenario(hf, len(tokenizer))
    for a, b, c in zip(got, again, want):
        assert torch.equal(a, b)
        assert (a - c).abs().max().item() <= NATIVE_TOL * max(1.0, c.abs().max().item())
    assert (got_kv - want_kv).abs().max().item() <= NATIVE_TOL * max(1.0, want_kv.abs().max().item())


def test_measure_plans_times_each_kind_once_per_process(tokenizer, monkeypatch, caplog):  # noqa: F811
    """The real timing on a tiny model: a valid plan per kind, logged, timed once per process and set
    of shapes (a second load reuses it, so both round alike)."""
    import logging

    monkeypatch.setattr(native_mod, "_MEASURED", {})
    calls = []
    timed = native_mod._time_kernels
    monkeypatch.setattr(native_mod, "_time_kernels", lambda *a, **k: calls.append(a[1]) or timed(*a, **k))
    with caplog.at_level(logging.INFO, logger=native_mod.__name__):
        first, hf = _forced(monkeypatch, "measured", "llama", len(tokenizer))
    assert "measured CPU plans" in caplog.text
    plans = first.native.plans()
    assert set(plans) == {"qkv", "o", "gate_up", "down", "lm_head"} and len(calls) == 2 * len(plans)
    assert all(set(p) == set(ROW_CLASSES) for p in plans.values())
    second, _ = _forced(monkeypatch, "measured", "llama", len(tokenizer))
    assert second.native.plans() == plans and len(calls) == 2 * len(plans)
    got, _ = run_scenario(first, len(tokenizer))
    want, _ = run_scenario(hf, len(tokenizer))
    for a, c in zip(got, want):
        assert (a - c).abs().max().item() <= NATIVE_TOL * max(1.0, c.abs().max().item())


def _dense_steps(adapter, vocab: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A causal prefill of 6 tokens, then three decode steps that see every row (an all-zero bias)."""
    cache = buffer_for(adapter, 16)
    ids = torch.randint(5, vocab, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    out = []
    for first, last in ((0, 6), (6, 7), (7, 8), (8, 9)):
        pos = list(range(first, last))
        cache.buffer.row_pos[first:last] = torch.tensor(pos)
        causal = torch.arange(last)[None, :] <= torch.tensor(pos)[:, None]
        bias = torch.zeros(len(pos), last).masked_fill_(~causal, float("-inf"))
        out.append(run(adapter, cache, ids[first:last], pos, bias, pos, last))
    return out, cache.buffer.data[:, :, :, :9].clone()


def test_a_decode_step_skips_an_all_zero_bias_bitwise(tokenizer, monkeypatch):  # noqa: F811
    """Decode steps whose row sees every cached row skip the bias adds; logits and states are
    bitwise those of adding it (and the masked prefill still adds its mask)."""
    native, _ = _forced(monkeypatch, "linear", "llama", len(tokenizer))
    decided = []
    needs = native_mod._needs_bias
    monkeypatch.setattr(native_mod, "_needs_bias", lambda bias, n: decided.append(needs(bias, n)) or decided[-1])
    skipped, skipped_kv = _dense_steps(native, len(tokenizer))
    assert decided == [True, False, False, False]
    monkeypatch.setattr(native_mod, "_needs_bias", lambda bias, n: True)
    added, added_kv = _dense_steps(native, len(tokenizer))
    for a, b in zip(skipped, added):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    assert torch.equal(skipped_kv, added_kv)


def test_per_row_and_measured_leave_other_dtypes_linear(tokenizer, monkeypatch):  # noqa: F811
    """The plans were measured in fp32: a bf16 model runs ``per-row`` / ``measured`` as ``linear``."""
    model = BY_NAME["llama"].build(len(tokenizer), dtype=torch.bfloat16)
    decoder = NativeDecoder(model, [None] * model.config.num_hidden_layers)
    for path in ("per-row", "measured"):
        decoder.set_cpu_path(path, measure=lambda d: pytest.fail("timed a bf16 model"))
        assert decoder.cpu_path == path and decoder.extra_bytes() == 0
        assert all(plan == PATH_PLANS["linear"][0] for plan in decoder.plans().values())
