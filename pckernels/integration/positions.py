"""How a model's cached keys depend on their position: can a block be moved by re-rotating keys?

Compact placement moves cached modules to positions other than the ones they were encoded at.
That is exact up to rounding when the model is *relative*: reading the same tokens ``delta``
positions later changes nothing but each RoPE layer's keys, which turn by ``R(delta)``. Rather
than trusting family names and config fields (per-layer RoPE bases in Gemma 3, NoPE layers in
SmolLM3, partial rotary in GPT-NeoX, scaled variants), :func:`probe_key_rotation` reads one short
sequence at two offsets and checks, layer by layer, which of the model's own ``inv_freq`` buffers
(or none) turns the first run's keys into the second's:

* ``rope``: keys turn by ``R(delta)`` (a zero ``inv_freq`` row for layers whose keys do not move);
* ``none``: no key moves and nothing else changes (ALiBi: the bias is rebuilt from positions);
* ``fixed``: the values change too (learned absolute positions, GPT-2), or keys move in a
  way no rotate-half RoPE reproduces (interleaved rotary, Cohere): blocks cannot be moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pckernels.integration.adapters import ModelAdapter
from pckernels.integration.attention import AttentionSpec
from pckernels.kernels.gather_rotate.naive import rerotate_keys_ref

PROBE_TOKENS = 5
PROBE_SHIFT = 37
"""Positions between the probe's two runs (odd, so no RoPE frequency aliases to the identity)."""


@dataclass(frozen=True)
class KeyRotation:
    """What moving a cached block by ``delta`` positions takes for one model.

    ``kind``: ``"rope"``, ``"none"`` or ``"fixed"`` (module docstring); ``inv_freq [L, half]``
    (float32) for ``rope``; ``reason`` says why a ``fixed`` model cannot move blocks.
    """

    kind: str
    inv_freq: torch.Tensor | None = None
    reason: str = ""

    @property
    def movable(self) -> bool:
        return self.kind != "fixed"


class _RecordingCache(DynamicCache):
    """The model's own dynamic cache, keeping a copy of the keys and values each layer caches."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.kv[layer_idx] = (key_states.detach().float().clone(), value_states.detach().float().clone())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _run(adapter: ModelAdapter, ids: torch.Tensor, start: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    model = adapter.model
    device = ids.device
    dtype = next(model.parameters()).dtype
    n = ids.shape[1]
    positions = torch.arange(start, start + n, device=device)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    bias = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(~causal, float("-inf"))
    cache = _RecordingCache(model.config)
    with torch.inference_mode():
        adapter.forward(ids, positions[None], AttentionSpec(bias, positions, positions), cache)
    return cache.kv


def _candidates(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's distinct ``*inv_freq`` buffers (1-D, float)."""
    out: list[torch.Tensor] = []
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq") and buf.dim() == 1 and buf.is_floating_point() and buf.numel():
            cand = buf.detach().float().cpu()
            if not any(c.shape == cand.shape and torch.equal(c, cand) for c in out):
                out.append(cand)
    return out


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() <= tol * max(scale, 1e-6)


def probe_key_rotation(adapter: ModelAdapter) -> KeyRotation:
    """Two forwards of :data:`PROBE_TOKENS` tokens, at 0 and at :data:`PROBE_SHIFT`; see the module docstring."""
    model = adapter.model
    param = next(model.parameters())
    tol = 1e-3 if param.dtype == torch.float32 else 6e-2
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, max(2, min(vocab, 1000)), (1, PROBE_TOKENS), generator=gen).to(param.device)
    first, moved = _run(adapter, ids, 0), _run(adapter, ids, PROBE_SHIFT)
    name = getattr(model.config, "model_type", type(model).__name__)
    candidates = _candidates(model)
    rows: list[torch.Tensor | None] = []
    for layer in sorted(first):
        (k0, v0), (k1, v1) = first[layer], moved[layer]
        if not _close(v1.cpu(), v0.cpu(), tol):
            return KeyRotation("fixed", reason=f"model type {name!r}: the values of layer {layer} change when the "
                                                  "same text is read at other positions (absolute position embeddings)")
        if _close(k1.cpu(), k0.cpu(), tol):
            rows.append(None)
            continue
        delta = torch.tensor(PROBE_SHIFT)
        match = next((c for c in candidates if 2 * c.numel() <= k0.shape[-1]
                      and _close(rerotate_keys_ref(k0.cpu(), delta, c), k1.cpu(), tol)), None)
        if match is None:
            return KeyRotation("fixed", reason=f"model type {name!r}: the keys of layer {layer} move in a way "
                                                  "rotate-half RoPE re-rotation does not reproduce")
        rows.append(match)
    halves = {r.numel() for r in rows if r is not None}
    if not halves:
        return KeyRotation("none")
    if len(halves) > 1:
        return KeyRotation("fixed", reason=f"model type {name!r}: layers rotate different numbers of dims "
                                              f"({sorted(2 * h for h in halves)})")
    half = halves.pop()
    inv = torch.stack([r if r is not None else torch.zeros(half) for r in rows]).to(param.device)
    return KeyRotation("rope", inv)
