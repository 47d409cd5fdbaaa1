"""Row attention (issue 41, item 5): a few new tokens over many rows, the mask given by rows.

The split-KV Triton kernel (under ``TRITON_INTERPRET=1`` here) and the torch path against the
plain reference (``kernels/row_attention/naive.py``) and against SDPA with the dense additive bias
the step builds today; FlexAttention (torch's eager reference on the CPU: compiled only on CUDA)
against the same; the backends through the HF forward and the engine against the dense path; the
option; and the kernel's offline sm_90 compile (no spills, 16-byte loads of K and V).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pckernels import ops
from pckernels.engine import PromptCache
from pckernels.engine.config import EngineConfig
from pckernels.engine.step import StepPlan
from pckernels.errors import OptionError
from pckernels.integration.row_attention import RowMask, attend_rows, resolve_attention
from pckernels.kernels._common import INTERPRET, HAS_TRITON
from pckernels.kernels.row_attention import row_attention_torch
from pckernels.kernels.row_attention.naive import row_allowed, row_attention_ref
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the Triton kernel runs: compiled on CUDA, interpreted on the CPU."""
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
triton_here = pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
                                 reason="needs Triton on CUDA or TRITON_INTERPRET=1")

# (Hq, Hkv, n, kv, D, groups of visibility, window)
SHAPES = [
    (4, 2, 3, 37, 16, 2, None),    # GQA, odd lengths
    (2, 2, 1, 1, 8, 1, None),      # one query, one row
    (6, 2, 5, 70, 6, 3, None),     # D not a power of two, three groups
    (3, 1, 16, 45, 16, 4, None),   # 16 new tokens, MQA
    (4, 1, 2, 50, 16, 1, 7),       # sliding window
    (8, 8, 16, 33, 16, 2, None),   # MHA, 16 tokens
]


def case(hq, hkv, n, kv, d, groups, window, dtype, *, poison=True, seed=0):
    """Random inputs and a random row mask; rows no query sees hold NaN (``poison``)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, n, d, generator=g).to(dtype)
    k = torch.randn(hkv, kv, d, generator=g).to(dtype)
    v = torch.randn(hkv, kv, d, generator=g).to(dtype)
    seen = torch.rand(groups, kv, generator=g) > 0.3
    group = torch.randint(0, groups, (n,), generator=g)
    query_pos = torch.randint(kv // 2, kv + 2, (n,), generator=g)
    key_pos = torch.randperm(kv, generator=g)
    start = torch.randint(0, 3, (n,), generator=g).int()
    stop = torch.randint(max(1, kv - 3), kv + 1, (n,), generator=g).int()
    if n > 1:
        start[-1], stop[-1] = kv, kv  # a query that sees nothing
    allowed = row_allowed(seen, group, query_pos, key_pos, start, stop, window)
    if poison:
        k[:, ~allowed.any(0)] = float("nan")
        v[:, ~allowed.any(0)] = float("nan")
    return (q, k, v, seen, group, query_pos, key_pos, start, stop), allowed


def on(args):
    """``args`` on :data:`DEVICE` (views keep their strides)."""
    return tuple(t.to(DEVICE) for t in args)


def dense_sdpa(q, k, v, allowed, scale):
    """Today's path: the dense additive bias and SDPA over grouped heads -> ``[n, Hq, D]``."""
    bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, scale=scale,
                                                           enable_gqa=q.shape[0] != k.shape[0])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}-n{s[2]}-kv{s[3]}-d{s[4]}" for s in SHAPES])
def test_torch_path_and_reference(shape, dtype):
    args, allowed = case(*shape, dtype)
    want = row_attention_ref(*args, 0.3, shape[-1])
    got = row_attention_torch(*args, 0.3, shape[-1])
    assert not want.isnan().any() and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    empty = ~allowed.any(1)
    assert (want[empty] == 0).all()


@triton_here
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}-n{s[2]}-kv{s[3]}-d{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_split_kv_kernel_matches_reference(shape, dtype, splits):
    """The kernel (NaN in the rows nobody sees, a query that sees nothing, 1..3 splits per head)
    equals the reference; the launch counter says the kernel ran."""
    args, _ = case(*shape, dtype)
    ops.reset_launch_counts()
    got = ops.row_attention(*on(args), scale=0.3, window=shape[-1], splits=splits, backend="triton").cpu()
    assert ops.launch_counts().get("row_attention") == 1
    want = row_attention_ref(*args, 0.3, shape[-1])
    assert got.shape == want.shape and got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@triton_here
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_kv_kernel_matches_dense_sdpa(dtype):
    """Against the dense path (finite rows, every query sees a row): SDPA over the additive bias."""
    for seed, shape in enumerate(SHAPES[:4]):
        args, allowed = case(*shape, dtype, poison=False, seed=seed)
        keep = allowed.any(1)
        got = ops.row_attention(*on(args), scale=0.25, backend="triton").cpu()
        want = dense_sdpa(args[0], args[1], args[2], allowed, 0.25)
        torch.testing.assert_close(got[keep].float(), want[keep].float(), atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)


@triton_here
@pytest.mark.triton
def test_split_kv_kernel_takes_strided_views():
    """q as HF hands it (``[1, Hq, n, D]`` transposed from ``[1, n, Hq, D]``), K/V as arena views
    (a plane of ``[L, 2, H, cap, D]`` cut to the extent)."""
    hq, hkv, n, kv, d = 4, 2, 3, 29, 16
    arena = torch.randn(2, 2, hkv, 40, d)
    q = torch.randn(n, hq, d).transpose(0, 1)
    args, _ = case(hq, hkv, n, kv, d, 2, None, torch.float32, poison=False)
    args = (q, arena[1, 0, :, :kv], arena[1, 1, :, :kv]) + args[3:]
    got = ops.row_attention(*on(args), scale=0.3, backend="triton").cpu()
    torch.testing.assert_close(got, row_attention_ref(*args, 0.3), atol=2e-5, rtol=2e-5)


def test_bad_arguments_are_refused():
    args, _ = case(4, 2, 3, 10, 8, 2, None, torch.float32)
    with pytest.raises(ValueError, match="seen must be bool"):
        ops.row_attention(*args[:3], args[3].int(), *args[4:], scale=1.0)
    with pytest.raises(ValueError, match="Hq a multiple"):
        ops.row_attention(args[0][:3], *args[1:], scale=1.0)
    with pytest.raises(ValueError, match="stop must be"):
        ops.row_attention(*args[:8], args[8][:2], scale=1.0)


def test_registered_op():
    args, _ = case(4, 2, 3, 10, 8, 2, None, torch.float32, poison=False)
    out = torch.ops.promptcache.row_attention(*args, 0.5, -1, -1, "torch")
    torch.testing.assert_close(out, row_attention_ref(*args, 0.5), atol=2e-5, rtol=2e-5)
    torch.library.opcheck(torch.ops.promptcache.row_attention.default, (*args, 0.5, -1, -1, "torch"))


def rows_of(args) -> RowMask:
    _, _, _, seen, group, query_pos, key_pos, start, stop = args
    return RowMask(seen, group, query_pos, key_pos, start, stop)


@pytest.mark.parametrize("backend", ["flex", "split_kv"])
def test_backends_through_attend_rows(backend):
    """The selection point's two backends (HF's shapes in and out) against the dense SDPA; flex in
    torch's eager mode on the CPU (its compiled kernels are CUDA's)."""
    if backend == "split_kv" and not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    args, allowed = case(6, 2, 4, 130, 16, 2, None, torch.float32, poison=False)
    keep = allowed.any(1)
    query, key, value = args[0][None], args[1][None], args[2][None]
    memo: dict = {}
    out = attend_rows(backend, query, key, value, rows_of(args), 0.25, memo)
    assert out.shape == (1, 4, 6, 16)
    want = dense_sdpa(args[0], args[1], args[2], allowed, 0.25)
    torch.testing.assert_close(out[0][keep], want[keep], atol=2e-5, rtol=2e-5)
    assert (out[0][~keep] == 0).all()
    if backend == "flex":
        assert len(memo) == 1  # one block mask per forward, shared by the layers
    for shape in ((2, 2, 17, 20, 8, 1, None), (16, 2, 9, 20, 8, 1, None)):  # 17 tokens; 72 rows per KV head
        too_many = case(*shape, torch.float32, poison=False)[0]
        assert (attend_rows(backend, too_many[0][None], too_many[1][None], too_many[2][None], rows_of(too_many),
                            None, {}) is None) == (backend == "split_kv")


def test_option_is_checked():
    assert EngineConfig().attention == "auto"
    assert resolve_attention("auto", torch.device("cuda")) == "dense"
    with pytest.raises(OptionError) as refused:
        EngineConfig(attention="fastest")
    assert refused.value.option == "attention"
    if not INTERPRET:
        with pytest.raises(OptionError, match="needs a CUDA device"):
            EngineConfig(device="cpu", attention="split_kv")


@pytest.fixture(scope="module")
def answers(tokenizer):  # noqa: F811
    """The same prompts through the HF forward (native forward off) on each backend, dynamic and
    static steps; every step's mask by rows checked against its dense mask."""
    checked = []
    original = StepPlan.build.__func__

    def build(cls, items, arena, dtype, device, static=None, rows=False):
        plan = original(cls, items, arena, dtype, device, static, rows)
        if plan.spec.rows is not None:
            q = sum(len(item.tokens) for item in items)
            dense = plan.spec.bias[:q] == 0
            assert torch.equal(plan.spec.rows.allowed()[:q], dense)
            checked.append(q)
        return plan

    mp = pytest.MonkeyPatch()
    mp.setenv("PROMPTCACHE_NATIVE", "0")
    mp.setattr(StepPlan, "build", classmethod(build))
    backends = ["dense", "flex"] + (["split_kv"] if INTERPRET else [])
    out = {}
    try:
        for backend in backends:
            for graphs in ("off", "static"):
                pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema", attention=backend,
                                 step_graphs=graphs)
                assert pc.adapter.native is None and pc.adapter.attention_backend == backend
                pc.add_schema(SCHEMA)
                handles = [pc.submit(PROMPTS[name], max_new_tokens=5) for name in ("none", "nested", "params-short")]
                out[backend, graphs] = [h.result() for h in handles]
                pc.close()
    finally:
        mp.undo()
    return out, checked


def test_backends_answer_as_dense_in_the_engine(answers):
    out, checked = answers
    assert checked and max(checked) > 1  # batched steps carried the mask by rows
    want = out["dense", "off"]
    for key, results in out.items():
        for got, ref in zip(results, want):
            assert got.token_ids == ref.token_ids, key
            assert (got.first_logits - ref.first_logits).abs().max().item() <= 1e-4, key


def test_ptx_split_kv_kernel_vectorises_without_spills():
    """Compiled offline for sm_90 (Llama-2-7B heads, bf16, 8,192 rows): K and V reach shared
    memory in 16-byte copies, no 2-byte scalar loads, and ptxas spills nothing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    script = ("import json; from perf.kernels import ptx\n"
              "r, u = ptx.run(['row_attention', 'row_attention_q1', 'row_attention_combine'], usage=True)\n"
              "print(json.dumps([r, u]))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and "cannot compile offline" in proc.stderr:
        pytest.skip(proc.stderr[-300:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result, usage = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("row_attention", "row_attention_q1"):
        loads = result[name]["loads"]
        assert loads.get("cp.async.cg.shared.global.16B", 0) >= 4, (name, loads)
        assert not any(k.endswith((".b16", ".u16", ".s16")) for k in loads), (name, loads)
    assert result["row_attention_combine"]["loads"].get("ld.global.v4.b32", 0) >= 1
    for name, used in usage.items():
        if "bytes spilled" in used:
            assert used.endswith(" 0 bytes spilled"), (name, used)


def test_bench_attention_plumbing():
    """``python -m perf.bench_attention --tiny``: every variant timed and compared with dense."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "perf.bench_attention", "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    variants = {r["variant"] for r in report["results"]}
    assert variants == {"dense", "dense_gqa", "flex", "flex_mask", "split_kv", "native", "split_torch"}
    for r in report["results"]:
        assert r["ms"] > 0
        if r["variant"] != "flex_mask":
            assert r["max_abs_vs_dense"] < 1e-5, r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (captured steps)")
@pytest.mark.parametrize("backend", ["flex", "split_kv"])
def test_backends_in_captured_steps_on_cuda(tokenizer, monkeypatch, backend):  # noqa: F811
    """On a GPU: the HF forward in captured steps (the CUDA default) with each backend answers as
    dense, and the capture did not fall back (or says why)."""
    monkeypatch.setenv("PROMPTCACHE_NATIVE", "0")
    out = {}
    for name in ("dense", backend):
        pc = PromptCache(tiny_llama(len(tokenizer)).cuda(), tokenizer, placement="schema", attention=name,
                         step_graphs="captured")
        pc.add_schema(SCHEMA)
        handles = [pc.submit(PROMPTS[p], max_new_tokens=5) for p in ("none", "nested", "params-short")]
        out[name] = ([h.result() for h in handles], pc.scheduler.runner.static)
        pc.close()
    (want, _), (got, static) = out["dense"], out[backend]
    assert static is not None and static.failed is None, static.failed
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert (a.first_logits.float().cpu() - b.first_logits.float().cpu()).abs().max().item() <= 1e-3
