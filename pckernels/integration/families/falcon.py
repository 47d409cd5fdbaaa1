"""Falcon: RoPE or ALiBi (``config.alibi``), multi-query or grouped KV heads.

KV layout: probed like every family's (transformers 5.24 broadcast each KV group of
``new_decoder_architecture`` to every query head before caching, 5.25 caches the groups).
ALiBi: Falcon builds it from the 2D mask's cumulative sum with its modeling module's
``build_alibi_tensor``, a module function with no per-instance hook. The first ALiBi Falcon
adapter wraps that function once, for the process: during a promptcache forward
(:func:`current_forward`, a context variable, so only the thread running that forward sees it)
it returns ALiBi from schema positions, shape ``[H, 1, kv]`` (Falcon views it per key, and the
per-query offset it drops is softmax-invariant); otherwise it is HF's function, called as is.
Nothing is swapped around a call. Falcon then scales and masks the bias itself.
"""

from __future__ import annotations

import sys
import threading

import torch

from pckernels.integration.adapters import ModelAdapter, register_adapter
from pckernels.integration.attention import current_forward

_install_lock = threading.Lock()


def _install_position_alibi(modeling) -> None:
    """Wrap ``modeling.build_alibi_tensor`` once with the position-aware dispatcher."""
    with _install_lock:
        original = modeling.build_alibi_tensor
        if getattr(original, "promptcache_positions", False):
            return
        slopes: dict[int, torch.Tensor] = {}

        def build_alibi_tensor(attention_mask, num_heads, dtype):
            state = current_forward()
            if state is None:
                return original(attention_mask, num_heads, dtype)
            if num_heads not in slopes:
                slopes[num_heads] = original(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]
            return state.alibi(slopes[num_heads], per_query=False).to(dtype)

        build_alibi_tensor.promptcache_positions = True
        build_alibi_tensor.__wrapped__ = original
        modeling.build_alibi_tensor = build_alibi_tensor


@register_adapter
class FalconAdapter(ModelAdapter):
    families = ("falcon",)
    row_attention = False  # ALiBi variants add it to the mask

    def attach(self) -> None:
        super().attach()
        if self.config.alibi:
            _install_position_alibi(sys.modules[type(self.model.base_model).__module__])

    def max_positions(self) -> int | None:
        return None if self.config.alibi else super().max_positions()
