"""promptcache's own forward for Llama-style decoders, reading and writing its KV buffer.

Driving HF's modules costs a decode step on CPU about as much as its matmuls: a dozen module
calls and some 45 small ops per layer, ``repeat_kv``-free SDPA that is slow for one query row,
and a mask built for the whole forward. For models whose architecture it recognises
(``model_type`` llama, mistral, qwen2, qwen3: RMSNorm, SiLU-gated MLP, RoPE with static
frequencies, optional q/k norms and projection biases), :class:`NativeDecoder` runs the same
math from the model's own weights in about twenty ops per layer:

* fused projections: q/k/v in one matmul and gate/up in another. The HF modules' weights become
  views into the fused tensors, so nothing is copied and the HF forward still works;
* RoPE from the forward's positions (cos/sin once per forward, q and k rotated together);
* keys and values written straight into the buffer rows the engine gives, attention read from
  the buffer by KV group (no copies per query head): two batched matmuls per layer for the few
  query rows of decode and short forwards (the mask added in place: ``baddbmm`` with a broadcast
  mask costs a decode step 40% more attention), SDPA in query chunks for long prefills;
* logits only for the rows asked for; a decode step whose row sees every cached row skips adding
  its (all-zero) bias.

The fp32 projections run on a *plan* per projection kind: a kernel per row-count class
(:data:`ROW_CLASSES`: one to three rows, 4-48, more; :data:`KERNELS`: ``F.linear`` or oneDNN's
inner product over the weight ``[out, in]``, or ``mm(x, W^T)`` over an ``[in, out]`` copy, which MKL
runs as a streaming GEMV on an AVX2-only CPU). A CPU path (:data:`CPU_PATHS`) names the plans,
chosen once at load by :func:`default_cpu_path` and logged with the plans and the memory they cost:
``"linear"`` (weights as the model has them; oneDNN for 4-48 rows), ``"per-row"`` (the AVX2
default: ``linear``, but the LM head's one-to-three-row GEMV on a transposed copy, ``vocab x hidden``
floats more), ``"transposed"`` (every weight ``[in, out]``, ``mm`` everywhere; the HF modules' weights
become views of it) and ``"measured"`` (each kind's plan timed at load, :func:`measure_plans`). A
weight is kept in one layout except the LM head's, so only the head ever costs a copy
(``docs/cpu-isa.md``). Each plan is deterministic; they agree to rounding.

``matmul="bf16"`` (never the default) runs every projection and the LM head as oneDNN bf16 matmuls
over weights packed once (AMX / AVX512-BF16 where the CPU has them), activations rounded to bf16
at each matmul's input; everything else stays in the model's dtype. It changes numerics: the
engine keys its blocks by it and ``perf`` measures its fidelity cost.

:meth:`NativeDecoder.build` returns None for anything it does not recognise, and checks itself
against the HF forward on a few random tokens before it is used (see :func:`self_check`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pckernels.integration.attention import QUERY_CHUNK, AttentionSpec, sdpa, visible_extents, windowed_bias

log = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "yarn", "llama3")
"""RoPE types whose frequencies do not depend on the forward's positions (``dynamic`` and
``longrope`` recompute them per forward; those models keep HF's path)."""

MATMULS = ("fp32", "bf16")

SMALL_QUERY = 64
"""Query rows up to which attention is one batched matmul per layer over the visible extent
(decode and short forwards); longer forwards use SDPA in ``QUERY_CHUNK``-row pieces
(:data:`~pckernels.integration.attention.QUERY_CHUNK`)."""


PER_HEAD_MAX = 4
"""With this many KV heads or fewer, short-forward attention runs one matmul pair per head (each
split over every thread) instead of one batched pair (split by head: 3 heads on 2 threads left one
idle half the time; 15.1 vs 17.9 ms per decode step at 4K on the embedded model, 2 threads)."""

ONEDNN_ROWS = (4, 48)
"""fp32 projections of this many rows (inclusive) run on oneDNN's inner product, the rest on MKL's
GEMM (``F.linear``): on the embedded model oneDNN is 15-35% faster for 4-48 rows on one thread
(``perf/results/cpu-x86_64-1t/linear``), within a few percent either way on two except 8 rows
(19% faster) and 48 (8% slower; ``perf/results/cpu-2c/linear``), and slower for one row."""

CPU_PATHS = ("linear", "transposed", "per-row", "measured")
"""fp32 projection paths (module docstring, :data:`PATH_PLANS`); ``$PROMPTCACHE_CPU_PATH`` forces one."""

CPU_PATH_ENV = "PROMPTCACHE_CPU_PATH"

SELF_CHECK_TOL = 1e-3
"""Largest |native - HF| of fp32 logits (relative to their spread) the self-check accepts."""

ROW_CLASSES = ("one", "few", "many")
"""Row-count classes a projection's kernel is chosen per: ``one`` fewer than ``ONEDNN_ROWS[0]``
(decode of one to three streams), ``few`` within :data:`ONEDNN_ROWS` (more streams, short
prefills), ``many`` beyond (prefills)."""

KERNELS = ("linear", "onednn", "mm_t")
"""``linear``: ``F.linear`` over the weight ``[out, in]`` (MKL); ``onednn``: oneDNN's inner product
over it (fp32, contiguous weight); ``mm_t``: ``mm(x, W^T)`` over a contiguous ``[in, out]`` copy
(MKL's streaming GEMV for one row on an AVX2-only CPU)."""

PATH_PLANS = {
    "linear": ({"one": "linear", "few": "onednn", "many": "linear"},) * 2,
    "transposed": ({"one": "mm_t", "few": "mm_t", "many": "mm_t"},) * 2,
    "per-row": ({"one": "linear", "few": "onednn", "many": "linear"},
                {"one": "mm_t", "few": "onednn", "many": "linear"}),
}
"""``path: (layers' plan, LM head's plan)``, a plan mapping each :data:`ROW_CLASSES` to a
:data:`KERNELS`. ``per-row`` keeps the layers as ``linear`` and gives the LM head a transposed copy
for one to three rows only (its 1.7-2.7x GEMV on the AVX2 EPYC; ``docs/cpu-isa.md``), costing
``vocab x hidden`` floats; ``measured`` is chosen per projection kind at load
(:func:`measure_plans`)."""


_ONEDNN = torch.backends.mkldnn.is_available()


def row_class(rows: int) -> str:
    """The :data:`ROW_CLASSES` entry of a product over ``rows`` rows."""
    lo, hi = ONEDNN_ROWS
    return "one" if rows < lo else ("few" if rows <= hi else "many")


def bf16_matmul_supported() -> bool:
    """Whether this build and CPU run oneDNN bf16 matmuls natively (AVX512-BF16 or AMX)."""
    if not torch.backends.mkldnn.is_available():
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check is not None and check() for check in checks)


def default_cpu_path() -> str:
    """The fp32 projection path for this host: ``$PROMPTCACHE_CPU_PATH`` when set (``auto``: the
    rule), else by torch's CPU capability: ``"per-row"`` where it is ``AVX2`` (no AVX-512: the LM
    head's one-row GEMV on a transposed copy measured 1.7x faster at one thread and 2.7x at two on
    the AVX2 EPYC, every other product as ``linear``; decode 1.08x of ``linear`` on two quiet
    threads there), ``"linear"`` elsewhere (unmeasured there). ``"transposed"`` everywhere decodes
    one stream faster still (1.16x of ``linear``) but 8 rows ~18% slower and 8 streams ~25% slower
    on the EPYC (its ``mm`` over 8 rows against oneDNN's inner product), so it stays opt-in, as
    does ``"measured"`` (a plan timed at load)."""
    forced = os.environ.get(CPU_PATH_ENV, "").strip()
    if forced and forced != "auto":
        if forced not in CPU_PATHS:
            raise ValueError(f"${CPU_PATH_ENV} must be one of {('auto', *CPU_PATHS)}, got {forced!r}")
        return forced
    return "per-row" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "linear"


class _Projection:
    """``x [n, in] -> [n, out]`` with the weight ``[out, in]`` (and bias) of one or more fused linears.

    ``views``: ``(module, start, stop)`` of the ``nn.Linear`` modules whose weights are rows
    ``start:stop`` of ``weight``; they follow the weight when :meth:`set_plan` moves it to an
    ``[in, out]`` layout. Without them (a head tied to the embeddings) the transposed layout is a
    copy. ``plan``: the :data:`KERNELS` entry per :data:`ROW_CLASSES`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 views: list[tuple[torch.nn.Module, int, int]] | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.views = views
        self.weight_t: torch.Tensor | None = None
        self.plan = dict(PATH_PLANS["linear"][0])
        self.packed = None
        self.bias16 = None

    @property
    def layout(self) -> str:
        """``out_in`` (as loaded), ``in_out`` (``weight`` a view of the contiguous ``weight_t``) or
        ``both`` (``weight_t`` a copy beside the contiguous ``weight``)."""
        if self.weight_t is None:
            return "out_in"
        return "both" if self.weight.is_contiguous() else "in_out"

    def extra_bytes(self) -> int:
        """Memory this projection holds beyond the model's own weights (a transposed copy)."""
        return self.weight_t.numel() * self.weight_t.element_size() if self.layout == "both" else 0

    def set_plan(self, plan: dict[str, str]) -> None:
        """Run each row class on ``plan``'s kernel and keep the weight in the layouts it needs: only
        ``mm_t`` -> ``[in, out]`` contiguous (the modules' weights become views of it; a tied head
        keeps a copy), ``mm_t`` and another -> a transposed copy beside ``[out, in]``, no ``mm_t``
        -> ``[out, in]`` contiguous as loaded."""
        if set(plan) != set(ROW_CLASSES) or not set(plan.values()) <= set(KERNELS):
            raise ValueError(f"a plan maps each of {ROW_CLASSES} to one of {KERNELS}, got {plan!r}")
        kernels = set(plan.values())
        want = "out_in" if "mm_t" not in kernels else ("in_out" if kernels == {"mm_t"} else "both")
        if want == "in_out" and self.views is None:
            want = "both"
        self.plan = dict(plan)
        if want == self.layout:
            return
        if want != "out_in" and self.weight_t is None:
            self.weight_t = self.weight.detach().t().contiguous()
        if want == "out_in":
            self.weight_t = None
        if want == "in_out":
            self.weight = self.weight_t.t()
        elif not self.weight.is_contiguous():
            self.weight = self.weight.contiguous()
        if self.views is not None:
            for module, start, stop in self.views:
                module.weight.data = self.weight[start:stop]

    def set_matmul(self, matmul: str) -> None:
        """``"bf16"``: pack a bf16 copy of the weight for oneDNN; ``"fp32"``: drop it."""
        self.packed = self.bias16 = None
        if matmul == "bf16":
            w16 = self.weight.detach().to(torch.bfloat16).contiguous()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w16, 1)
            self.bias16 = None if self.bias is None else self.bias.detach().to(torch.bfloat16)

    def run(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """``x`` through ``kernel`` (one of :data:`KERNELS`) in fp32; one the layout lacks, or
        oneDNN for another dtype or where it is absent, falls back to ``F.linear``."""
        if kernel == "mm_t" and self.weight_t is not None and x.dtype == self.weight_t.dtype:
            if self.bias is None:
                return torch.mm(x, self.weight_t)
            return torch.addmm(self.bias, x, self.weight_t)
        if (kernel == "onednn" and _ONEDNN and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and self.weight.is_contiguous()):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, self.bias16, "none", [], "")
            return y.to(x.dtype)
        return self.run(x, self.plan[row_class(x.shape[0])])


@dataclass
class _Layer:
    norm_in: torch.Tensor
    qkv: _Projection
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: _Projection
    norm_post: torch.Tensor
    gate_up: _Projection
    down: _Projection
    window: int | None
    scaling: float


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list]:
    """One ``[sum(out), in]`` weight (and bias) for ``linears`` and the modules' row ranges; each
    module's parameters become views into it, so the model computes as before with no extra memory."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = None
    if any(has_bias):
        bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                          for m in linears])
    start = 0
    views = []
    for m in linears:
        stop = start + m.out_features
        m.weight.data = weight[start:stop]
        if m.bias is not None:
            m.bias.data = bias[start:stop]
        views.append((m, start, stop))
        start = stop
    return weight, bias, views


def _recognised(model) -> str | None:
    """None when ``model`` is a decoder this module can run, else why not."""
    config = model.config
    if getattr(config, "model_type", None) not in FAMILIES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {FAMILIES}"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"model.model has no {name}"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "lm_head is not a Linear"
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"hidden_act {getattr(config, 'hidden_act', None)!r}"
    rope_type = getattr(inner.rotary_emb, "rope_type", None)
    if rope_type not in STATIC_ROPE:
        return f"RoPE type {rope_type!r} recomputes its frequencies per forward"
    inv_freq = getattr(inner.rotary_emb, "inv_freq", None)
    head_dim = getattr(inner.layers[0].self_attn, "head_dim", None) if len(inner.layers) else None
    if inv_freq is None or head_dim is None or 2 * inv_freq.numel() != head_dim:
        return "RoPE does not rotate the whole head (partial rotary)"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        needed = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        needed += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(m, torch.nn.Linear) for m in needed):
            return "a layer's projections are not plain Linear modules"
        if getattr(mlp.down_proj, "bias", None) is not None or mlp.gate_proj.bias is not None:
            return "MLP biases"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not hasattr(norm, "variance_epsilon") or norm.weight.dim() != 1:
                return "a norm is not RMSNorm"
        if getattr(attn, "scaling", None) is None:
            return "attention has no scaling"
    return None


def _needs_bias(bias: torch.Tensor, n: int) -> bool:
    """Whether the attention of ``n`` query rows must add ``bias``: a short forward (decode) that
    sees every row has an all-zero bias, and adding it changes no score (``x + 0 == x``), so its
    90-odd small adds per step are skipped; SDPA's chunks always take the mask."""
    return n > SMALL_QUERY or bool(bias.any())


class NativeDecoder:
    """The forward of a recognised decoder over a promptcache KV buffer (module docstring).

    ``windows[i]``: layer i's sliding window (None: global). Use :meth:`build`.
    """

    def __init__(self, model, windows: list[int | None]) -> None:
        self.model = model
        self.matmul = "fp32"
        self.cpu_path = "linear"
        inner = model.model
        config = model.config
        self.embed = inner.embed_tokens.weight
        self.hidden = self.embed.shape[1]
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.q_heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.q_heads
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scaling = float(rotary.attention_scaling)
        self.norm = inner.norm.weight
        self.eps = float(inner.norm.variance_epsilon)
        head = model.lm_head
        tied = head.weight is inner.embed_tokens.weight
        self.lm_head = _Projection(head.weight, head.bias, None if tied else [(head, 0, head.out_features)])
        self.layers: list[_Layer] = []
        for index, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            self.layers.append(_Layer(
                norm_in=layer.input_layernorm.weight, qkv=_Projection(*qkv),
                q_norm=None if q_norm is None else q_norm.weight,
                k_norm=None if k_norm is None else k_norm.weight,
                o=_Projection(attn.o_proj.weight, attn.o_proj.bias, [(attn.o_proj, 0, attn.o_proj.out_features)]),
                norm_post=layer.post_attention_layernorm.weight,
                gate_up=_Projection(*gate_up),
                down=_Projection(mlp.down_proj.weight, None, [(mlp.down_proj, 0, mlp.down_proj.out_features)]),
                window=windows[index], scaling=float(attn.scaling)))
        self.q_size = self.q_heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim

    def projections(self) -> list[_Projection]:
        return [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def kinds(self) -> dict[str, list[_Projection]]:
        """The projections by kind (one shape each): ``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``."""
        out = {name: [getattr(layer, name) for layer in self.layers] for name in ("qkv", "o", "gate_up", "down")}
        out["lm_head"] = [self.lm_head]
        return out

    def plans(self) -> dict[str, dict[str, str]]:
        """Each kind's plan (the kernel per row class; the first projection of the kind)."""
        return {kind: dict(projections[0].plan) for kind, projections in self.kinds().items() if projections}

    def extra_bytes(self) -> int:
        """Memory the projections hold beyond the model's weights (transposed copies)."""
        return sum(p.extra_bytes() for p in self.projections())

    def modules_as_loaded(self) -> bool:
        """Whether the HF modules' weights are still ``[out, in]`` contiguous (their own forward then
        rounds exactly as before the native forward was built)."""
        return all(p.layout != "in_out" for p in self.projections())

    def set_matmul(self, matmul: str) -> None:
        """Run the projections as ``"fp32"`` (the model's dtype) or ``"bf16"`` matmuls."""
        if matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
        for projection in self.projections():
            projection.set_matmul(matmul)
        self.matmul = matmul

    def set_plans(self, plans: dict[str, dict[str, str]]) -> None:
        """Give each kind in ``plans`` (see :meth:`kinds`) its plan (:meth:`_Projection.set_plan`)."""
        kinds = self.kinds()
        unknown = set(plans) - set(kinds)
        if unknown:
            raise ValueError(f"unknown projection kinds {sorted(unknown)}; known: {sorted(kinds)}")
        for kind, plan in plans.items():
            for projection in kinds[kind]:
                projection.set_plan(plan)

    def set_cpu_path(self, path: str, measure=None) -> None:
        """Run fp32 projections on ``path`` (one of :data:`CPU_PATHS`; module docstring). ``measured``
        times the kernels here (:func:`measure_plans`, once per process and set of shapes; ``measure``
        replaces it, for tests). A model in another dtype runs ``per-row`` and ``measured`` as
        ``linear`` (they were measured in fp32)."""
        if path not in CPU_PATHS:
            raise ValueError(f"cpu_path must be one of {CPU_PATHS}, got {path!r}")
        if path in ("per-row", "measured") and self.embed.dtype != torch.float32:
            plans = {kind: PATH_PLANS["linear"][0] for kind in self.kinds()}  # measured on fp32 only
        elif path == "measured":
            self.set_plans({kind: PATH_PLANS["linear"][0] for kind in self.kinds()})
            plans = (measure or measure_plans)(self)
        else:
            layers, head = PATH_PLANS[path]
            plans = {kind: head if kind == "lm_head" else layers for kind in self.kinds()}
        self.set_plans(plans)
        self.cpu_path = path

    @classmethod
    def build(cls, model, windows: list[int | None], matmul: str = "fp32",
              cpu_path: str | None = None) -> "NativeDecoder | None":
        """A decoder for ``model``, or None (logged) when its architecture is not recognised or
        it fails :func:`self_check` against the HF forward. ``matmul="bf16"`` raises
        ``ValueError`` instead of returning None: the caller asked for something only this
        forward gives. ``cpu_path`` (None: :func:`default_cpu_path`) is logged."""
        if matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
        cpu_path = default_cpu_path() if cpu_path is None else cpu_path
        if cpu_path not in CPU_PATHS:
            raise ValueError(f"cpu_path must be one of {CPU_PATHS}, got {cpu_path!r}")
        why = _recognised(model)
        if why is None and matmul == "bf16" and not bf16_matmul_supported():
            why = "this CPU or torch build has no native bf16 matmul"
        if why is not None:
            if matmul != "fp32":
                raise ValueError(f"matmul={matmul!r} needs promptcache's native forward, which this model cannot "
                                 f"use: {why}")
            log.info("%s keeps HF's forward: %s", type(model).__name__, why)
            return None
        decoder = cls(model, windows)
        error = self_check(decoder)
        if error is not None:
            if matmul != "fp32":
                raise ValueError(f"promptcache's native forward disagrees with HF's for this model: {error}")
            log.warning("%s keeps HF's forward: the native forward disagrees with it (%s)",
                        type(model).__name__, error)
            return None
        decoder.set_cpu_path(cpu_path)
        decoder.set_matmul(matmul)
        log.info("%s runs promptcache's native forward: %s matmuls, CPU path %r (torch CPU capability %s, "
                 "%d threads; plans %s; %.1f MB of transposed copies)", type(model).__name__, matmul, cpu_path,
                 torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), decoder.plans(),
                 decoder.extra_bytes() / 1e6)
        return decoder

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [n, 1, D]`` for ``positions [n]`` (HF's fp32 angles, cast to ``dtype``); the
        first half of ``sin`` negated, so ``rotate_half(x) * sin == x.roll(D / 2) * sin``."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None]
        half = freqs.shape[1]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)
        sin = (emb.sin() * self.rope_scaling).to(dtype)
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos[:, None], sin[:, None]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, spec: AttentionSpec, cache,
                keep: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[k, vocab]`` of the rows ``keep [k]`` (all rows when None) for ``input_ids [n]``
        at ``positions [n]``; keys and values go to ``cache``'s buffer (``cache.write_rows [n]``, or
        the rows from ``cache.write_start``), attention reads rows ``0 .. cache.extent - 1`` under
        ``spec.bias [n, extent]``."""
        data = cache.buffer.data
        extent = cache.extent
        rows, start = cache.write_rows, cache.write_start
        n = input_ids.shape[0]
        dtype = data.dtype
        h = F.embedding(input_ids, self.embed)
        cos, sin = self._rope(positions, h.dtype)
        half = self.head_dim // 2
        biases: dict[int | None, torch.Tensor] = {}
        masked: dict[int | None, bool] = {}
        extents: dict[int | None, list[int]] = {}
        for index, layer in enumerate(self.layers):
            x = F.rms_norm(h, (self.hidden,), layer.norm_in, self.eps)
            qkv = layer.qkv(x)
            # q and k rotated together, in place in qkv, so that k and v stay adjacent there and
            # go to the layer's rows in one copy
            qk = qkv[:, :self.q_size + self.kv_size].view(n, self.q_heads + self.kv_heads, self.head_dim)
            if layer.q_norm is not None:
                qk[:, :self.q_heads] = F.rms_norm(qk[:, :self.q_heads], (self.head_dim,), layer.q_norm, self.eps)
                qk[:, self.q_heads:] = F.rms_norm(qk[:, self.q_heads:], (self.head_dim,), layer.k_norm, self.eps)
            rolled = qk.roll(half, -1)
            qk.mul_(cos).addcmul_(rolled, sin)
            q = qk[:, :self.q_heads]
            kv = qkv[:, self.q_size:].view(n, 2, self.kv_heads, self.head_dim).permute(1, 2, 0, 3)
            layer_rows = data[index]
            if rows is None:
                layer_rows[:, :, start:start + n] = kv
            else:
                layer_rows.index_copy_(2, rows, kv.to(dtype))
            keys, values = layer_rows[0], layer_rows[1]
            bias = biases.get(layer.window)
            if bias is None:
                bias = biases[layer.window] = windowed_bias(spec, layer.window).to(h.dtype)
                masked[layer.window] = _needs_bias(bias, n)
            out = self._attend(q, keys[:, :extent], values[:, :extent], bias if masked[layer.window] else None,
                               layer.scaling, extents, layer.window)
            h.add_(layer.o(out))
            x = F.rms_norm(h, (self.hidden,), layer.norm_post, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h.add_(layer.down(F.silu(gate).mul_(up)))
        if keep is not None:
            h = h.index_select(0, keep)
        return self.lm_head(F.rms_norm(h, (self.hidden,), self.norm, self.eps))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                scaling: float, extents: dict, window) -> torch.Tensor:
        """``q [n, Hq, D]`` over ``keys, values [Hkv, extent, D]`` (buffer views) with the additive
        ``bias [n, extent]`` (None: all zero; only for ``n <= SMALL_QUERY``) -> ``[n, Hq * D]``."""
        n = q.shape[0]
        groups = self.q_heads // self.kv_heads
        if n <= SMALL_QUERY:
            qg = (q * scaling).view(n, self.kv_heads, groups, self.head_dim).permute(1, 2, 0, 3).reshape(
                self.kv_heads, groups * n, self.head_dim)
            if self.kv_heads <= PER_HEAD_MAX:
                out = torch.stack([self._attend_head(qg[h], keys[h], values[h], bias, groups, n)
                                   for h in range(self.kv_heads)])
            else:
                scores = torch.bmm(qg, keys.transpose(1, 2))
                if bias is not None:
                    scores.view(self.kv_heads, groups, n, -1).add_(bias)
                out = torch.bmm(torch.softmax(scores, dim=-1).to(values.dtype), values)
            return out.view(self.kv_heads, groups, n, self.head_dim).permute(2, 0, 1, 3).reshape(n, self.q_size)
        query = q.transpose(0, 1)[None]
        key, value = keys[None], values[None]
        mask = bias[None, None]
        if window not in extents:
            extents[window] = visible_extents(mask, QUERY_CHUNK)
        pieces = []
        for index, stop in enumerate(extents[window]):
            first, last = index * QUERY_CHUNK, min(index * QUERY_CHUNK + QUERY_CHUNK, n)
            pieces.append(sdpa(query[:, :, first:last], key[:, :, :stop], value[:, :, :stop],
                                mask[:, :, first:last, :stop], scaling, True))
        return torch.cat(pieces, dim=1)[0].reshape(n, self.q_size)

    @staticmethod
    def _attend_head(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, groups: int,
                     n: int) -> torch.Tensor:
        """One KV head: ``q [groups * n, D]`` (scaled) over ``keys, values [extent, D]`` -> ``[groups * n, D]``."""
        scores = torch.mm(q, keys.t())
        if bias is not None:
            scores.view(groups, n, -1).add_(bias)
        return torch.mm(torch.softmax(scores, dim=-1).to(values.dtype), values)


MEASURE_MARGIN = 0.05
"""How much faster (fraction) ``mm_t`` must measure than the kernels over ``[out, in]`` before
:func:`measure_plans` moves a weight or pays for a copy (so that noise keeps the loaded layout)."""

MEASURE_ROWS = {"one": 1, "few": 8}
"""Rows a row class is timed at by :func:`measure_plans` (``many`` is not timed: ``linear``)."""

_MEASURED: dict[tuple, dict[str, dict[str, str]]] = {}
"""Plans :func:`measure_plans` chose in this process, by threads, capability and shapes: filled at
load only, so every decoder of a process over the same shapes runs (and rounds) alike."""


def _time_kernels(projections: list[_Projection], rows: int, kernels: list[str], reps: int,
                  timer) -> dict[str, float]:
    """Fastest of ``reps`` interleaved rounds (s) of ``rows`` rows through every projection of a
    kind (all layers, so the weights stream from memory as in a forward) per kernel."""
    weights = [p.weight.detach() if p.weight.is_contiguous() else p.weight.detach().contiguous() for p in projections]
    transposed = [w.t().contiguous() for w in weights] if "mm_t" in kernels else []
    x = torch.randn(rows, weights[0].shape[1], generator=torch.Generator().manual_seed(0)).to(weights[0].dtype)
    biases = [None if p.bias is None else p.bias.detach() for p in projections]

    def one(kernel: str) -> None:
        for index, w in enumerate(weights):
            if kernel == "mm_t":
                t, b = transposed[index], biases[index]
                torch.mm(x, t) if b is None else torch.addmm(b, x, t)
            elif kernel == "onednn":
                torch.ops.mkldnn._linear_pointwise(x, w, biases[index], "none", [], "")
            else:
                F.linear(x, w, biases[index])

    best = {kernel: math.inf for kernel in kernels}
    with torch.inference_mode():
        for kernel in kernels:
            one(kernel)
        for rep in range(reps):
            for kernel in kernels[rep % len(kernels):] + kernels[:rep % len(kernels)]:
                start = timer()
                one(kernel)
                best[kernel] = min(best[kernel], timer() - start)
    return best


def choose_plan(times: dict[str, dict[str, float]], head: bool) -> dict[str, str]:
    """A kind's plan from ``times[row_class][kernel]`` (s, the classes of :data:`MEASURE_ROWS`).

    Layers (``head=False``) take one layout: ``[in, out]`` (every class on ``mm_t``) when the
    geometric mean over the classes of ``mm_t``'s time over the best ``[out, in]`` kernel's is
    below ``1 - MEASURE_MARGIN``, else each class its fastest ``[out, in]`` kernel. The LM head
    (``head=True``) may keep both layouts (a copy): each class takes ``mm_t`` where it beats the
    best other kernel by the margin, else that kernel; ``many`` stays ``linear``."""
    plan = {}
    ratios = []
    for cls, per in times.items():
        others = {k: v for k, v in per.items() if k != "mm_t"}
        fastest = min(others, key=others.get)
        plan[cls] = fastest
        if "mm_t" in per:
            ratio = per["mm_t"] / max(others[fastest], 1e-12)
            ratios.append(ratio)
            if head and ratio < 1 - MEASURE_MARGIN:
                plan[cls] = "mm_t"
    if not head and ratios and math.prod(ratios) ** (1 / len(ratios)) < 1 - MEASURE_MARGIN:
        return {cls: "mm_t" for cls in ROW_CLASSES}
    plan["many"] = "linear"
    for cls in ROW_CLASSES:
        plan.setdefault(cls, "linear")
    return plan


def measure_plans(decoder: "NativeDecoder", reps: int = 5, timer=time.perf_counter) -> dict[str, dict[str, str]]:
    """Each projection kind's plan on this host, chosen by timing :data:`KERNELS` at
    :data:`MEASURE_ROWS` on the current thread count (:func:`choose_plan`); the times and choices
    are logged, and kept for the process (:data:`_MEASURED`). A fp32 weight only."""
    kinds = decoder.kinds()
    key = (torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(),
           tuple((kind, tuple(ps[0].weight.shape), ps[0].weight.dtype, len(ps)) for kind, ps in kinds.items()))
    if key in _MEASURED:
        return _MEASURED[key]
    kernels = ["linear", "onednn", "mm_t"] if _ONEDNN else ["linear", "mm_t"]
    plans, report = {}, {}
    for kind, projections in kinds.items():
        if projections[0].weight.dtype != torch.float32:
            plans[kind] = dict(PATH_PLANS["linear"][0])
            continue
        times = {cls: _time_kernels(projections, rows, kernels, reps, timer) for cls, rows in MEASURE_ROWS.items()}
        plans[kind] = choose_plan(times, head=kind == "lm_head")
        report[kind] = {cls: {k: round(v * 1e3, 3) for k, v in per.items()} for cls, per in times.items()}
    log.info("measured CPU plans (%d threads, capability %s; ms per kind, fastest of %d): %s -> %s",
             key[0], key[1], reps, report, plans)
    _MEASURED[key] = plans
    return plans


class _ProbeBuffer:
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data


class _ProbeCache:
    """The minimal cache :meth:`NativeDecoder.forward` reads: a buffer, write rows, an extent."""

    def __init__(self, data: torch.Tensor) -> None:
        self.buffer = _ProbeBuffer(data)
        self.write_rows: torch.Tensor | None = None
        self.write_start = 0
        self.extent = 0


def self_check(decoder: NativeDecoder, tokens: int = 7) -> str | None:
    """None when the native forward (before any ``set_matmul``) reproduces HF's logits on ``tokens``
    random tokens — a prefill of all but two, then two more over the cached rows — else what differed."""
    model = decoder.model
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    vocab = decoder.embed.shape[0]
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(tokens, device=device) + 3
    with torch.inference_mode():
        expected = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
        data = torch.zeros(len(decoder.layers), 2, decoder.kv_heads, tokens, decoder.head_dim, dtype=dtype,
                           device=device)
        cache = _ProbeCache(data)
        causal = positions[None, :] <= positions[:, None]
        bias = torch.zeros(tokens, tokens, dtype=dtype, device=device).masked_fill_(~causal, float("-inf"))
        got = []
        for first, last in ((0, tokens - 2), (tokens - 2, tokens)):
            cache.write_start, cache.extent = first, last
            spec = AttentionSpec(bias[first:last, :last], positions[first:last], positions[:last])
            got.append(decoder.forward(ids[first:last], positions[first:last], spec, cache, None))
        got = torch.cat(got).to(expected.dtype)
    spread = float(expected.float().std()) or 1.0
    error = float((got - expected).abs().max()) / spread
    tol = SELF_CHECK_TOL if dtype == torch.float32 else 5e-2
    if not math.isfinite(error) or error > tol:
        return f"max |native - HF| = {error:.3g} of the logits' spread (tolerance {tol:g})"
    return None
