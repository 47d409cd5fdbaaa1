"""promptcache's attention is selected per model instance and changes nothing process-wide.

During a promptcache forward no module namespace of transformers or torch changes (nothing is
swapped and restored around a call); another model in the same process, run at the same time
from another thread, computes exactly what it computes alone; outside promptcache forwards the
selected attention and ALiBi builders are HF's own.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from transformers import DynamicCache

from family_models import BY_NAME
from pckernels import PromptCache
from pckernels.integration import attention
from pckernels.integration import native as native_mod
from pckernels.integration.adapters import adapter_for
from pckernels.integration.attention import ATTENTION
from test_cpu_attention import long_prompt
from test_families import prompt_cache, tokenizer  # noqa: F401  (fixture)

WATCHED_MODULES = ("transformers.integrations.sdpa_attention", "transformers.masking_utils",
                   "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
                   "transformers.models.falcon.modeling_falcon", "transformers.models.mpt.modeling_mpt",
                   "transformers.models.bloom.modeling_bloom", "torch.nn.functional")


def process_state(model: torch.nn.Module) -> dict:
    """Identities of every name in the watched module namespaces and HF's attention registries,
    plus the model instance's own attributes and attention implementation."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    state = {}
    for name in WATCHED_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            state[name] = {key: id(value) for key, value in vars(module).items()}
    for label, registry in (("attention", ALL_ATTENTION_FUNCTIONS), ("masks", ALL_MASK_ATTENTION_FUNCTIONS)):
        state[label] = {key: id(value) for key, value in registry._global_mapping.items()}
        state[label + "-local"] = {key: id(value) for key, value in getattr(registry, "_local_mapping", {}).items()}
    state["instance"] = {key: id(value) for key, value in vars(model.base_model).items() if not key.startswith("_")}
    state["impl"] = model.config._attn_implementation
    return state


@pytest.mark.parametrize("family,native", [("llama", True), ("llama", False), ("falcon-alibi", True),
                                           ("mpt", True), ("bloom", True), ("gemma3", True)])
def test_nothing_process_wide_changes_during_a_forward(tokenizer, family, native, monkeypatch):  # noqa: F811
    pc = prompt_cache(family, tokenizer, native)
    monkeypatch.setattr(pc.adapter, "query_chunk", 5)
    before = process_state(pc.model)
    during = []
    if pc.adapter.native is not None:
        layer = pc.adapter.native.layers[0]
        original = layer.o

        def spy(x):
            during.append(process_state(pc.model))
            return original(x)

        monkeypatch.setattr(layer, "o", spy)
        result = pc.generate(long_prompt(), max_new_tokens=2)
    else:
        layer = next(m for m in pc.model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block")))
        hook = layer.register_forward_pre_hook(lambda *args: during.append(process_state(pc.model)))
        try:
            result = pc.generate(long_prompt(), max_new_tokens=2)
        finally:
            hook.remove()
    assert result.computed_tokens > 5
    assert during
    for seen in during:
        assert seen == before
    assert process_state(pc.model) == before


def twin_llama(tokenizer):  # noqa: F811
    return BY_NAME["llama"].build(len(tokenizer))


def padded_forward(model) -> torch.Tensor:
    """HF's own forward of a left-padded batch of two (2D mask): logits ``[2, 6, vocab]``."""
    ids = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=model.config)).logits


@pytest.mark.parametrize("cpu_path", native_mod.CPU_PATHS)
def test_the_selection_is_per_instance_and_plain_calls_are_hf_sdpa(tokenizer, monkeypatch, cpu_path):  # noqa: F811
    """The engine's model uses promptcache's attention, its twin keeps ``sdpa``; HF's own
    (padded, 2D-masked) forward of the engine's model is bitwise the twin's on the ``linear`` CPU
    path. On ``transposed`` (opt-in, ``$PROMPTCACHE_CPU_PATH``: the modules' weights become views of ``[in, out]``
    tensors, so their matmuls round differently) it equals the twin's to fp32 rounding."""
    monkeypatch.setenv(native_mod.CPU_PATH_ENV, cpu_path)
    pc = PromptCache(BY_NAME["llama"].build(len(tokenizer)), tokenizer, placement="schema")  # fresh: its own path
    assert pc.adapter.native is not None and pc.adapter.native.cpu_path == cpu_path
    twin = twin_llama(tokenizer)
    assert pc.model.config._attn_implementation == ATTENTION
    assert twin.config._attn_implementation == "sdpa"
    mine, theirs = padded_forward(pc.model), padded_forward(twin)
    if pc.adapter.native.modules_as_loaded():  # linear, per-row (its head copy is the native forward's own)
        assert torch.equal(mine, theirs)
    else:
        assert (mine - theirs).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())


def test_another_model_running_concurrently_is_unaffected(tokenizer, monkeypatch):  # noqa: F811
    """Thread 1 answers chunked, grouped promptcache prompts; thread 2 runs HF's forward of an
    unrelated model with a padding mask. Each computes exactly what it computes alone."""
    pc = prompt_cache("llama", tokenizer)
    monkeypatch.setattr(pc.adapter, "query_chunk", 5)
    other = twin_llama(tokenizer)
    alone_other = padded_forward(other)
    alone_pc = pc.generate(long_prompt(), max_new_tokens=3)
    errors, other_outputs, pc_outputs = [], [], []
    start = threading.Barrier(2)

    def run_pc():
        start.wait()
        for _ in range(3):
            pc_outputs.append(pc.generate(long_prompt(), max_new_tokens=3))

    def run_other():
        start.wait()
        for _ in range(12):
            other_outputs.append(padded_forward(other))

    threads = [threading.Thread(target=target) for target in (run_pc, run_other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors
    assert len(other_outputs) == 12 and len(pc_outputs) == 3
    for logits in other_outputs:
        assert torch.equal(logits, alone_other)
    for result in pc_outputs:
        assert result.token_ids == alone_pc.token_ids
        assert torch.equal(result.first_logits, alone_pc.first_logits)


def test_falcon_alibi_builder_is_hf_s_outside_promptcache_forwards(tokenizer):  # noqa: F811
    """The position-aware ``build_alibi_tensor`` is installed once and, outside a promptcache
    forward, returns exactly what HF's function returns."""
    pc = prompt_cache("falcon-alibi", tokenizer)
    modeling = sys.modules[type(pc.model.base_model).__module__]
    builder = modeling.build_alibi_tensor
    assert builder.promptcache_positions
    adapter_for(pc.model)
    assert modeling.build_alibi_tensor is builder
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert torch.equal(builder(mask, 4, torch.float32), builder.__wrapped__(mask, 4, torch.float32))
    assert attention.current_forward() is None


def test_an_unattached_adapter_leaves_the_model_alone(tokenizer):  # noqa: F811
    """Reading a model's limits (the prefix cache does) must not select an attention or wrap a
    builder: only an attached adapter (the engine's) prepares the model."""
    for name in ("llama", "mpt"):
        model = BY_NAME[name].build(len(tokenizer))
        impl = model.config._attn_implementation
        before = dict(vars(model.base_model))
        adapter = adapter_for(model, attach=False)
        assert adapter.max_positions() is not None or name != "llama"
        assert model.config._attn_implementation == impl and dict(vars(model.base_model)) == before
        adapter.attach()
        assert model.config._attn_implementation == (ATTENTION if impl == "sdpa" else impl)
