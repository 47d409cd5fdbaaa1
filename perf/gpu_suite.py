"""The GPU suite in one call: a random-initialised Llama-2-7B-shaped model in bf16 (built from a
config on the device; no weight files, no hub, no tokenizer file — prompts use the word
tokenizer of ``perf/suite/tokenizer.py``).

1. Exactness: cached == reference (greedy tokens, first-logit max-abs) on both store tiers;
   compact placement launches its Triton kernels in ``generate()`` (launch counters).
2. TTFT at 1K–8K tokens, side by side: no reuse; Prompt Cache with blocks copied from the
   device tier; from the pinned-host tier (a second engine over the same model whose device
   budget is 0); blocks resident in the assembly buffer; the floor (uncached forward only).
3. Memory per cached token (computed and measured).
4. Kernel GB/s: ``perf/kernels/gpu_check.py --skip-tests`` (gather, scatter, RoPE vs copy).
5. Attention for a few new tokens over many rows: ``python -m perf.bench_attention --gpu`` (dense
   SDPA vs FlexAttention vs the split-KV kernel; ``--no-attention`` skips it).

Targets (issue 8): >= 15x at 5K tokens with the device tier, >= 3x with the pinned-host tier.

    python -m perf --gpu [--out DIR] [--repeats 5] [--lengths 1024 2048 4096 5120 8000] [--no-kernels]
    python -m perf --gpu --dry-run      # CPU: a tiny Llama-shaped model, short prompts
    python -m perf.gpu_suite …          # the same
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

from pckernels.engine import PromptCache
from perf.suite.config import SuiteConfig
from perf.suite.context import Bench, Ticker
from perf.suite.memory import KVShape
from perf.suite.runner import RESULTS_ROOT, environment, machine_name
from perf.suite.tokenizer import WordTokenizer
from perf.suite.ttft import SERIES, archive_schema, measure_length

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
LLAMA2_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=8192)
DRY_RUN_SHAPE = dict(LLAMA2_7B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=128)
GPU_LENGTHS = [1024, 2048, 4096, 5120, 8000]
DRY_RUN_LENGTHS = [64, 128]
TARGET_TOKENS = 5120
TARGETS = {"device": 15.0, "host": 3.0}


def random_llama(shape: dict, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """A Llama with ``shape`` (``LlamaConfig`` fields), random weights made directly on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype)
    return model.eval()


def engines(model: torch.nn.Module, tokenizer, dtype: torch.dtype) -> tuple[PromptCache, PromptCache]:
    """``(device_tier, host_tier)`` over one model: the first keeps blocks in device memory, the
    second (device budget 0) in host memory, pinned on CUDA, copied up for every prompt."""
    device = next(model.parameters()).device
    device_tier = PromptCache(model, tokenizer, device=device, dtype=dtype, name="llama-2-7b-shaped",
                              device_budget="64GiB", host_budget="1GiB", placement="schema")
    host_tier = PromptCache(model, tokenizer, device=device, dtype=dtype, name="llama-2-7b-shaped",
                            device_budget=0, host_budget="64GiB", placement="schema")
    return device_tier, host_tier


def exactness(device_tier: PromptCache, host_tier: PromptCache, n_tokens: int, new_tokens: int = 8) -> dict:
    """Cached vs the reference oracle on the device tier, and the host tier vs the device tier."""
    schema, prompt = archive_schema(device_tier.tokenizer, n_tokens, "exact")
    for engine in (device_tier, host_tier):
        engine.add_schema(schema)
        engine.evict_resident()
    cached = device_tier.generate(prompt, max_new_tokens=new_tokens)
    oracle = device_tier.generate(prompt, max_new_tokens=new_tokens, mode="reference")
    host = host_tier.generate(prompt, max_new_tokens=new_tokens)
    diff = float((cached.first_logits - oracle.first_logits).abs().max())
    return {"tokens": n_tokens, "cached_equals_reference": cached.token_ids == oracle.token_ids,
            "first_logits_max_abs_diff": diff, "first_logits_scale": float(oracle.first_logits.abs().max()),
            "host_equals_device": host.token_ids == cached.token_ids and torch.equal(host.first_logits,
                                                                                    cached.first_logits)}


def compact_check(engine: PromptCache, n_tokens: int, new_tokens: int = 8) -> dict:
    """Compact placement in ``generate()``: the Triton kernels that must run do (launch counters:
    the moved block's gather-rotate, the new rows' scatter), and the moved prompt with every stale
    token recomputed equals the reference (full causal attention at the compact positions)."""
    from pckernels import ops
    from perf.suite.texts import archive, pml_escape, sized

    each = max(8, n_tokens // 3)
    docs = "".join(f'<module name="p{i}">{pml_escape(sized(engine.tokenizer, archive(500 + i), each))}\n</module>'
                   for i in range(3))
    engine.add_schema(f'<schema name="compact-check"><system>Answer from the passages.\n{docs}</system></schema>')
    prompt = ('<prompt schema="compact-check" placement="compact"><p2/><p0/><user>Which goods were traded?</user>'
              '<assistant/></prompt>')
    engine.evict_resident()
    ops.reset_launch_counts()
    cached = engine.generate(prompt, max_new_tokens=new_tokens)
    launches = ops.launch_counts()
    oracle = engine.generate(prompt, max_new_tokens=new_tokens, mode="reference")
    full = engine.generate(prompt, max_new_tokens=new_tokens, recompute=1.0)
    full_oracle = engine.generate(prompt, max_new_tokens=new_tokens, mode="reference", recompute=1.0)
    moved = sum(1 for ref in engine.request(prompt).plan.blocks if ref.shifts)
    needed = ("gather_rotate", "scatter_rows") if engine.device.type == "cuda" else ()
    return {"tokens": 2 * each, "moved_blocks": moved, "launches": launches,
            "kernels_launched": all(launches.get(k, 0) > 0 for k in needed),
            "compact_vs_reference_max_abs": float((cached.first_logits - oracle.first_logits).abs().max()),
            "compact_greedy_equals_reference": cached.token_ids == oracle.token_ids,
            "full_recompute_vs_reference_max_abs": float((full.first_logits - full_oracle.first_logits).abs().max()),
            "full_recompute_equals_reference": full.token_ids == full_oracle.token_ids}


def memory(device_tier: PromptCache, shape: dict) -> dict:
    layout = device_tier.layout
    keys = device_tier.store.keys()
    tokens = sum(k.tokens for k in keys)
    computed = KVShape("gpu model", layout.num_layers, layout.num_kv_heads, layout.head_dim)
    return {"computed_bytes_per_token": computed.bytes_per_token(torch.empty(0, dtype=device_tier.dtype).element_size()),
            "store_bytes_per_token": device_tier.store.nbytes() / tokens if tokens else None, "store_tokens": tokens,
            "shape": shape}


def kernel_check(dry_run: bool) -> dict:
    """Run the kernels' one-shot GPU check as a subprocess; its printed table is the result."""
    cmd = [sys.executable, str(ROOT / "perf" / "kernels" / "gpu_check.py"), "--dry-run" if dry_run else "--skip-tests"]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return {"command": " ".join(cmd), "returncode": done.returncode, "seconds": time.perf_counter() - started,
            "output": done.stdout + done.stderr}


def attention_check(dry_run: bool) -> dict:
    """Run ``perf.bench_attention`` (``--gpu``; ``--tiny`` on a dry run) as a subprocess; its table
    and JSON are the result."""
    cmd = [sys.executable, "-m", "perf.bench_attention", "--tiny" if dry_run else "--gpu"]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except ValueError:
        report = None
    text = "\n".join(line for line in lines[:-1] if line.startswith("|"))
    return {"command": " ".join(cmd), "returncode": done.returncode, "seconds": time.perf_counter() - started,
            "output": text or (done.stdout + done.stderr)[-4000:], "report": report}


def ttft_table(rows: list[dict]) -> list[str]:
    lines = ["| tokens | no reuse | device tier | pinned host | resident | floor | x device | x host | x resident |"
             " device / floor |", "|" + "---|" * 10]
    for r in rows:
        cell = {k: f"{r[k]['median'] * 1e3:.1f} ms ({r[k]['min'] * 1e3:.1f}–{r[k]['max'] * 1e3:.1f})"
                for k in ("baseline", "cached", "cached_host", "cached_resident", "floor")}
        lines.append(f"| {r['tokens']} | {cell['baseline']} | {cell['cached']} | {cell['cached_host']} | "
                     f"{cell['cached_resident']} | {cell['floor']} | {r['speedup']:.1f}x | {r['speedup_host']:.1f}x | "
                     f"{r['speedup_resident']:.1f}x | {r['cached_over_floor']:.2f} |")
    return lines


def target_lines(rows: list[dict]) -> list[str]:
    at = min(rows, key=lambda r: abs(r["tokens"] - TARGET_TOKENS))
    return [f"- device tier >= {TARGETS['device']:.0f}x at ~{TARGET_TOKENS} tokens: "
            f"{'met' if at['speedup'] >= TARGETS['device'] else 'NOT met'} ({at['speedup']:.1f}x at {at['tokens']})",
            f"- pinned-host tier >= {TARGETS['host']:.0f}x: "
            f"{'met' if at['speedup_host'] >= TARGETS['host'] else 'NOT met'} ({at['speedup_host']:.1f}x)"]


def summary(results: dict) -> str:
    env, check, mem = results["environment"], results["exactness"], results["memory"]
    lines = [f"# promptcache GPU suite — {env['machine']}", "",
             f"Random Llama-2-7B-shaped model ({env['dtype']}) on {env['device']}; torch {env['torch']}, "
             f"transformers {env['transformers']}; {results['repeats']} interleaved rounds, median (min–max); "
             f"{results['elapsed_s']:.0f} s.", "", "## Targets", "", *target_lines(results["ttft"]["rows"]), "",
             "## Exactness", "",
             f"- cached == reference at {check['tokens']} tokens: {check['cached_equals_reference']} (first-logit "
             f"max-abs diff {check['first_logits_max_abs_diff']:.3g} on logits up to "
             f"{check['first_logits_scale']:.3g})",
             f"- pinned-host tier == device tier (tokens and logits): {check['host_equals_device']}", ""]
    if "compact" in results:
        c = results["compact"]
        lines += ["## Compact placement", "",
                  (f"- Triton kernels launched during generate() (gather_rotate, scatter_rows): "
                   f"{c['kernels_launched']} — launches {c['launches']} ({c['moved_blocks']} moved blocks)"),
                  (f"- compact vs reference: first-logit max-abs {c['compact_vs_reference_max_abs']:.3g}, greedy equal "
                   f"{c['compact_greedy_equals_reference']} (the moved passage's context distance changed: not exact "
                   "by design)"),
                  (f"- every stale token recomputed vs reference: max-abs "
                   f"{c['full_recompute_vs_reference_max_abs']:.3g}, greedy equal "
                   f"{c['full_recompute_equals_reference']}"),
                  ""]
    lines += ["## TTFT", "", *ttft_table(results["ttft"]["rows"]), "", "## Memory per token", "",
              f"computed {mem['computed_bytes_per_token'] / 1024:.1f} KiB, measured "
              f"{(mem['store_bytes_per_token'] or 0) / 1024:.1f} KiB ({mem['store_tokens']} tokens stored)", ""]
    if "kernels" in results:
        lines += ["## Kernels (`perf/kernels/gpu_check.py`)", "", "```", results["kernels"]["output"].strip(), "```",
                  ""]
    if "attention" in results:
        lines += ["## Attention for a few new tokens (`python -m perf.bench_attention --gpu`)", "",
                  results["attention"]["output"].strip(), ""]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf --gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: tiny model and prompts; kernels on tiny shapes in the Triton interpreter")
    ap.add_argument("--lengths", type=int, nargs="+")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-kernels", action="store_true", help="skip perf/kernels/gpu_check.py")
    ap.add_argument("--no-attention", action="store_true", help="skip perf.bench_attention")
    ap.add_argument("--out", type=Path, help="output directory (default perf/results/<gpu>/gpu)")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def run(args: argparse.Namespace) -> dict:
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to check the script on CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shape = DRY_RUN_SHAPE if args.dry_run else LLAMA2_7B
    lengths = args.lengths or (DRY_RUN_LENGTHS if args.dry_run else GPU_LENGTHS)
    started = time.perf_counter()
    torch.manual_seed(0)
    print(f"building a random Llama ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}) on {device} "
          f"in {dtype} …", flush=True)
    model = random_llama(shape, device, dtype)
    device_tier, host_tier = engines(model, WordTokenizer(shape["vocab_size"]), dtype)
    results: dict = {"environment": environment(device_tier), "repeats": args.repeats, "shape": shape}
    print("exactness …", flush=True)
    results["exactness"] = exactness(device_tier, host_tier, lengths[0])
    print("compact placement …", flush=True)
    results["compact"] = compact_check(device_tier, lengths[0])
    config = SuiteConfig(name="gpu", repeats=args.repeats, lengths=lengths, experiments=["ttft"])
    bench = Bench(device_tier, config, Ticker())
    rows = []
    for n in lengths:
        rows.append(measure_length(bench, n, tiers={"host": host_tier}))
        print(ttft_table(rows)[-1], flush=True)
    series = dict(SERIES, cached="Prompt Cache, device tier", cached_host="Prompt Cache, pinned-host tier")
    results["ttft"] = {"rows": rows, "series": series}
    results["memory"] = memory(device_tier, shape)
    if not args.no_kernels:
        print("kernels …", flush=True)
        results["kernels"] = kernel_check(args.dry_run)
    if not args.no_attention:
        print("attention …", flush=True)
        results["attention"] = attention_check(args.dry_run)
    results["elapsed_s"] = time.perf_counter() - started
    return results


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    results = run(args)
    out_dir = args.out or RESULTS_ROOT / (machine_name("cuda") if torch.cuda.is_available() and not args.dry_run
                                          else "cpu-dry-run") / "gpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_suite.json").write_text(json.dumps(results, indent=1, default=str))
    text = summary(results)
    (out_dir / "gpu_summary.md").write_text(text)
    from perf.suite.plots import plt, ttft_panel

    fig, ax = plt.subplots(figsize=(7, 4.8))
    ttft_panel(ax, results["ttft"])
    fig.tight_layout()
    fig.savefig(out_dir / "gpu_ttft.png", dpi=110)
    plt.close(fig)
    print(text)
    print(f"\nwrote {out_dir}/gpu_suite.json, gpu_summary.md, gpu_ttft.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
