"""Liger-style patch: HF Llama-family ``apply_rotary_pos_emb`` -> the fused promptcache op.

Off by default. ``apply_promptcache_rope()`` swaps the module-level function in the HF
modeling modules of llama, mistral, qwen2 and qwen3 (those that import); attention forwards
look the name up in their module globals at call time, so already-built models of those
classes follow. ``model=`` additionally patches the modules that define the classes of an
already-built model (e.g. remote-code copies). ``revert_promptcache_rope()`` restores
everything. The fused op computes in fp32 and rounds once (HF rounds after each op in
half precision), runs q and k in one launch, and falls back to the original function for
inputs it does not cover.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import types

import torch

log = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_NAME = "apply_rotary_pos_emb"
_patched: dict[str, tuple[types.ModuleType, object]] = {}


def _make_fused(original):
    """A replacement with ``original``'s signature that calls the fused op when it applies."""
    from pckernels import extras

    params = inspect.signature(original).parameters

    def _covered(q, k, cos, sin, unsqueeze_dim) -> bool:
        return (
            unsqueeze_dim in (1, 2) and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3
            and cos.shape == sin.shape and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and cos.shape[-1] <= q.shape[-1] and cos.shape[-1] % 2 == 0
        )

    if "position_ids" in params:

        def fused(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            if _covered(q, k, cos, sin, unsqueeze_dim):
                return extras.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
            return original(q, k, cos, sin, position_ids, unsqueeze_dim)

    else:

        def fused(q, k, cos, sin, unsqueeze_dim=1):
            if _covered(q, k, cos, sin, unsqueeze_dim):
                return extras.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    fused.__name__ = _NAME
    fused.__doc__ = "promptcache fused RoPE (q and k in one launch); falls back to HF's function."
    fused._promptcache_original = original
    return fused


def _patch_module(mod: types.ModuleType) -> bool:
    fn = getattr(mod, _NAME, None)
    if fn is None or not callable(fn):
        return False
    if getattr(fn, "_promptcache_original", None) is not None:
        return True
    _patched[mod.__name__] = (mod, fn)
    setattr(mod, _NAME, _make_fused(fn))
    log.info("promptcache RoPE patched into %s", mod.__name__)
    return True


def _resolve(module) -> types.ModuleType:
    if isinstance(module, types.ModuleType):
        return module
    name = module if "." in module else f"transformers.models.{module}.modeling_{module}"
    return importlib.import_module(name)


def apply_promptcache_rope(model: torch.nn.Module | None = None, *, module=None) -> list[str]:
    """Patch HF's ``apply_rotary_pos_emb`` with the fused op; returns the patched module names.

    ``module``: one modeling module (object, full name, or family name such as ``"llama"``)
    instead of every family in :data:`FAMILIES` that imports. ``model``: also patch the
    modules defining the classes of this already-built model's submodules.
    """
    done = []
    if module is not None:
        mods = [_resolve(module)]
    elif model is None:
        mods = []
        for fam in FAMILIES:
            try:
                mods.append(_resolve(fam))
            except ImportError:
                log.debug("transformers has no %s modeling module", fam)
    else:
        mods = []
    if model is not None:
        seen = {m.__name__ for m in mods}
        for sub in model.modules():
            mod = sys.modules.get(type(sub).__module__)
            if mod is not None and mod.__name__ not in seen and hasattr(mod, _NAME):
                seen.add(mod.__name__)
                mods.append(mod)
    for mod in mods:
        if _patch_module(mod):
            done.append(mod.__name__)
    return done


def revert_promptcache_rope() -> list[str]:
    """Restore every patched module's original function; returns the restored module names."""
    names = []
    for name, (mod, fn) in list(_patched.items()):
        setattr(mod, _NAME, fn)
        names.append(name)
        del _patched[name]
    return names


def is_patched(module) -> bool:
    """Whether ``module`` (object or name) currently carries the fused function."""
    fn = getattr(_resolve(module), _NAME, None)
    return getattr(fn, "_promptcache_original", None) is not None


revert = revert_promptcache_rope
