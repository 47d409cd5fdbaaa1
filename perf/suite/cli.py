"""Command line of the suite: ``python -m perf …`` and ``promptcache bench …``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from perf.suite.config import EXPERIMENTS, SuiteConfig

DESCRIPTION = """promptcache performance suite: TTFT vs length (baseline / Prompt Cache / floor), workloads
(no reuse / exact prefix reuse / Prompt Cache), cache-hit-ratio sweep, encoding amortisation, memory
per token, decode rate. Writes suite.json, summary.md and PNG plots under
perf/results/<machine>/<preset>/; while it runs, suite.partial.json there holds the experiments done.

  python -m perf --quick                  a few minutes on 2 CPU cores
  python -m perf                          the full run (512 -> 8K tokens)
  python -m perf --only ttft --lengths 512 1024 --repeats 3
  python -m perf --resume                 go on after an interrupted run (same settings)
  python -m perf --gpu [--dry-run]        the one-shot GPU suite (perf/gpu_suite.py)
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the quick preset (same as --preset quick)")
    ap.add_argument("--preset", choices=("full", "quick", "tiny"), default=None)
    ap.add_argument("--only", nargs="+", choices=EXPERIMENTS, help="run only these experiments")
    ap.add_argument("--repeats", type=int, help="interleaved rounds per measurement")
    ap.add_argument("--ttft-repeats", type=int,
                    help="rounds for TTFT vs length only (default: --repeats); its ratios to the floor are "
                         "a few percent and need more rounds than the rest")
    ap.add_argument("--lengths", type=int, nargs="+", help="TTFT prompt lengths in tokens")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--model", default="smollm2", help="model name or path (default: the embedded SmolLM2; "
                                                       "qwen2.5-coder-0.5b: fetched on first use)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--matmul", choices=("fp32", "bf16"), default="fp32",
                    help="promptcache's matmul precision on CPU (bf16: oneDNN over packed weights)")
    ap.add_argument("--prefix-block", type=int, help="tokens per block of exact prefix reuse (default 256)")
    ap.add_argument("--prefix-resume", choices=("block", "token"), default="block",
                    help="where plain prompts' hits resume: block (bitwise, the default) or token (from the first "
                         "new token, equal to rounding: PromptCache(prefix_resume=...))")
    ap.add_argument("--placement", choices=("schema", "compact"), default="schema",
                    help="placement of the PML prompts (default schema: the paper's semantics, whose answers the "
                         "suite checks against the reference forward; compact is the library's default, measured "
                         "against schema placement by perf.bench_defaults)")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python for the llamacpp experiment "
                                           "(default: $PROMPTCACHE_LLAMACPP_PYTHON, then this one)")
    ap.add_argument("--peer-contexts", type=int, nargs="+",
                    help="document sizes in tokens for the llamacpp experiment (default 4096 8064; a size that is "
                         "not a multiple of --prefix-block shows where plain prompts' hits resume)")
    ap.add_argument("--peer-flash", action="store_true",
                    help="also run llama.cpp with flash attention (slower for it on these CPUs)")
    ap.add_argument("--lookahead", type=int,
                    help="the llamacpp experiment also decodes with prompt-lookup drafts of up to this many "
                         "tokens, on both engines (PromptCache(lookahead=...))")
    ap.add_argument("--out", type=Path, help="output directory (default perf/results/<machine>/<preset>)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="keep the experiments an interrupted run of the same settings finished (its "
                         "suite.partial.json in the output directory) and run only the rest")
    ap.add_argument("--gpu", action="store_true", help="run perf/gpu_suite.py with the remaining arguments")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--gpu" in argv:
        from perf import gpu_suite

        argv.remove("--gpu")
        return gpu_suite.main(argv)
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("perf").setLevel(logging.INFO)
    import torch

    from pckernels.engine import PromptCache
    from pckernels.engine.options import check_load_options
    from perf.suite.runner import PARTIAL_NAME, default_out_dir, read_checkpoint, run_suite, write_results

    try:
        check_load_options(args.model, args.device, args.dtype)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    torch.set_num_threads(args.threads)
    preset = args.preset or ("quick" if args.quick else "full")
    config = SuiteConfig.named(preset).with_overrides(experiments=args.only, repeats=args.repeats,
                                                      ttft_repeats=args.ttft_repeats, lengths=args.lengths,
                                                      prefix_block_size=args.prefix_block, peer_python=args.llama_python,
                                                      peer_threads=args.threads, peer_flash=args.peer_flash or None,
                                                      peer_contexts=args.peer_contexts,
                                                      peer_lookahead=args.lookahead)
    if (args.only or args.repeats or args.ttft_repeats or args.lengths or args.prefix_block or args.matmul != "fp32"
            or args.peer_flash or args.peer_contexts or args.lookahead or args.prefix_resume != "block"
            or args.placement != "schema"):
        config.name = f"{preset}-custom"
    print(f"loading {args.model} …", flush=True)
    engine = PromptCache.from_pretrained(args.model, device=args.device, dtype=args.dtype, store_dir=False,
                                         matmul=args.matmul, prefix_block_size=config.prefix_block_size,
                                         prefix_resume=args.prefix_resume, placement=args.placement)
    out_dir = args.out or default_out_dir(engine, config)
    checkpoint = out_dir / PARTIAL_NAME
    previous = read_checkpoint(checkpoint) if args.resume else None
    if args.resume and previous is None:
        print(f"nothing to resume in {out_dir}: starting from the beginning", flush=True)
    try:
        results = run_suite(engine, config, show_progress=not args.no_progress, checkpoint=checkpoint,
                            resume=previous)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = write_results(results, out_dir)
    checkpoint.unlink(missing_ok=True)
    print(summary.read_text())
    print(f"\nwrote {out_dir}/suite.json, summary.md and plots", flush=True)
    return 0
