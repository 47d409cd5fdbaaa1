"""The static-shape / captured step against the dynamic one, and the request path's host waits.

    python -m perf.bench_graphs                 # CPU: the embedded model, eager vs static shapes
    python -m perf.bench_graphs --gpu           # CUDA: random Llama-2-7B-shaped bf16, + captured
    python -m perf.bench_graphs --gpu --dry-run # the GPU script's logic on CPU (a tiny model)

Three parts, each timed round-robin (median of ``--repeats``) so drift hits the variants alike:

* ``floor``: one forward of ``--tokens`` new tokens (and of one) over ``--rows`` resident arena
  rows, as a step runs it — ``graphs.dynamic_forward`` at exact shapes (``off``), the
  :class:`~pckernels.engine.graphs.StaticStep` eager (``static``) and, on CUDA, replayed from a
  captured graph (``captured``); each timing includes writing the inputs and the mask and the
  readout of the logits, and the variants' logits are compared (max-abs).
* ``decode``: an engine's decode rate (tokens/s) for 1 and 8 streams over a ``--module``-token
  module, per ``step_graphs`` mode on one engine (the mode switched between rounds).
* ``syncs`` (CUDA): one request under ``torch.cuda.set_sync_debug_mode("warn")``: every
  synchronising call but the step's readout, by file and line (expected: none).

Prints one JSON object (also written to ``--out`` when given). On a lent GPU (a few minutes):

    python -m perf.bench_graphs --gpu --out perf/results/<device>/graphs/bench.json
    python -m pytest -q -p no:cacheprovider tests/test_step_syncs.py tests/test_step_graphs.py -k cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from pckernels.engine import PromptCache, graphs
from pckernels.engine.arena import KVArena
from pckernels.engine.buffer import BufferCache
from pckernels.engine.graphs import StaticStep, StepGraphs
from pckernels.integration.attention import AttentionSpec

LLAMA2_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=16384)
TINY = dict(LLAMA2_7B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=128)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_llama(shape: dict, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype).eval()


def round_robin(fns: dict, repeats: int, device: torch.device) -> dict:
    """``name -> fn()`` timed in turns; median and min wall milliseconds of each."""
    walls: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            walls[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": round(statistics.median(w), 3), "min_ms": round(min(w), 3)} for name, w in walls.items()}


@torch.inference_mode()
def floor(engine: PromptCache, tokens: int, rows: int, repeats: int, capture: bool) -> dict:
    """One step of ``tokens`` new tokens over ``rows`` resident rows, per variant (module docstring)."""
    ctx = engine.context
    device, dtype = torch.device(ctx.device), ctx.dtype
    arena = KVArena(ctx.layout, dtype=dtype, device=device, max_bytes=(rows + 256) * 4 * 1024 * 1024)
    taken = arena.allocate(rows + tokens + 1)
    real = engine.scheduler.runner.arena.data  # the model's own keys and values (random ones make
    have = min(real.shape[3], 1024)              # CPU softmax weights denormal: 10 ms per matmul)
    for first in range(0, len(taken), have):
        count = min(have, len(taken) - first)
        arena.data[:, :, :, first:first + count] = real[:, :, :, :count]
    arena.row_pos[:len(taken)] = torch.arange(len(taken), device=device)
    cache = BufferCache(arena)
    vocab = ctx.adapter.config.vocab_size
    ids_list = torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    pos_list = list(range(rows, rows + tokens))
    row_list = taken[rows:rows + tokens]
    keep_list = [tokens - 1]
    extent = rows + tokens
    scratch = taken[-1]

    def mask(positions: torch.Tensor, width: int) -> torch.Tensor:
        key_pos = arena.row_pos[:width]
        seen = (key_pos[None, :] <= positions[:, None]) & (torch.arange(width, device=device) < extent)[None, :]
        return seen

    def dynamic():
        ids = graphs.stage([ids_list], torch.long, device)
        positions = graphs.stage(pos_list, torch.long, device)
        rows_t = graphs.stage(row_list, torch.long, device)
        keep = graphs.stage(keep_list, torch.long, device)
        bias = torch.full((tokens, extent), float("-inf"), dtype=dtype, device=device)
        bias.masked_fill_(mask(positions, extent), 0.0)
        spec = AttentionSpec(bias, positions, arena.row_pos[:extent])
        return graphs.readout(graphs.dynamic_forward(ctx.adapter, cache, ids, positions, rows_t, extent, spec, keep))

    def static_step(step: StaticStep):
        def run():
            ids, positions, rows_t, keep, bias = step.load(ids_list, pos_list, row_list, keep_list, extent)
            bias[:tokens].fill_(float("-inf")).masked_fill_(mask(positions[:tokens], bias.shape[1]), 0.0)
            out = step.forward(ctx.adapter, cache, ids, positions, rows_t, keep, bias, arena.row_pos[:bias.shape[1]])
            return graphs.readout(out[:len(keep_list)])
        return run

    variants = {"off": dynamic,
                "static": static_step(StaticStep(arena, dtype, device, scratch, StepGraphs("static"), capture=False))}
    captured = None
    if capture:
        captured = StaticStep(arena, dtype, device, scratch, StepGraphs("captured"), capture=True)
        variants["captured"] = static_step(captured)
    logits = {name: fn().float() for name, fn in variants.items()}  # warm-up (and capture)
    logits = {name: fn().float() for name, fn in variants.items()}
    result = {"tokens": tokens, "rows": rows, **round_robin(variants, repeats, device),
              "max_abs_vs_off": {name: float((out - logits["off"]).abs().max()) for name, out in logits.items()},
              "max_abs_logit": float(logits["off"].abs().max())}
    if captured is not None:
        result["capture"] = {"captures": captured.captures, "replays": captured.replays, "failed": captured.failed}
    return result


def decode(engine: PromptCache, prompt: str, modes: list[str], streams: int, new_tokens: int, rounds: int) -> dict:
    """Decode tokens/s of ``streams`` requests at once, per ``step_graphs`` mode (one engine; its
    runner's mode switched between rounds)."""
    runner = engine.scheduler.runner
    rates: dict = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            runner.graph_mode = mode
            engine.generate(prompt, max_new_tokens=2)  # blocks resident, buckets warm
            requests = [engine.request(prompt.replace("</user>", f" {i}</user>"), max_new_tokens=new_tokens)
                        for i in range(streams)]
            start = time.perf_counter()
            handles = [engine.submit(r) for r in requests]
            results = [h.result() for h in handles]
            wall = time.perf_counter() - start - max(r.ttft_s for r in results)
            rates[mode].append(sum(len(r.token_ids) - 1 for r in results) / max(wall, 1e-9))
    return {mode: round(statistics.median(r), 2) for mode, r in rates.items()}


def syncs(engine: PromptCache, prompt: str) -> dict:
    """Synchronising calls of one request on CUDA but the readout (``file:line`` -> count)."""
    def allowed(original):
        """The readout, and a bucket's one-time capture (``torch.cuda.graph`` synchronises)."""
        def call(*args, **kwargs):
            torch.cuda.set_sync_debug_mode(0)
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("warn")
        return call

    readout, capture = graphs.readout, StaticStep._capture

    engine.evict_resident()
    request = engine.request(prompt, max_new_tokens=8)
    torch.cuda.synchronize()
    graphs.readout, StaticStep._capture = allowed(readout), allowed(capture)
    by_line: dict = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = engine.submit(request).result()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message).lower():
                place = f"{Path(w.filename).name}:{w.lineno}"
                by_line[place] = by_line.get(place, 0) + 1
    finally:
        graphs.readout, StaticStep._capture = readout, capture
    return {"tokens": len(result.token_ids), "syncs": sum(by_line.values()), "by_line": by_line,
            "thread": threading.current_thread().name}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="random Llama-2-7B-shaped bf16 model on CUDA")
    ap.add_argument("--dry-run", action="store_true", help="with --gpu: a tiny model on the CPU")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--rows", type=int, default=None, help="resident rows (default 5120 GPU, 1024 CPU)")
    ap.add_argument("--module", type=int, default=None, help="module tokens for decode (default 4096 GPU, 512 CPU)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    gpu = args.gpu and not args.dry_run
    if gpu and not torch.cuda.is_available():
        print("--gpu needs CUDA (use --dry-run to try the logic on CPU)", file=sys.stderr)
        return 2
    from perf.suite.tokenizer import WordTokenizer
    from perf.suite.ttft import archive_schema

    if args.gpu:
        device = torch.device("cuda" if gpu else "cpu")
        dtype = torch.bfloat16 if gpu else torch.float32
        model = random_llama(LLAMA2_7B if gpu else TINY, device, dtype)
        tokenizer = WordTokenizer(model.config.vocab_size)
        engine = PromptCache(model, tokenizer, device=device, dtype=dtype, name="bench-graphs",
                             model_id="bench-graphs-random", placement="schema", kv_budget="24GiB" if gpu else None,
                             step_graphs="off")
        rows, module = args.rows or (5120 if gpu else 96), args.module or (4096 if gpu else 64)
        modes = ["off", "static"] + (["captured"] if gpu else [])
    else:
        engine = PromptCache.from_pretrained("smollm2", placement="schema", step_graphs="off")
        tokenizer = engine.context.tokenizer
        rows, module = args.rows or 1024, args.module or 512
        modes = ["off", "static"]
    out: dict = {"device": str(engine.device), "dtype": str(engine.dtype), "torch": torch.__version__,
                 "command": "python -m perf.bench_graphs " + " ".join(argv if argv is not None else sys.argv[1:])}
    if gpu:
        out["gpu"] = torch.cuda.get_device_name()
    schema, prompt = archive_schema(tokenizer, module, "benchgraphs")
    engine.add_schema(schema)
    engine.generate(prompt, max_new_tokens=2)  # the module's rows in the arena: real keys for the floor
    # on the scheduler thread, as steps run (another thread's OpenMP team would slow the CPU down)
    out["floor"] = [engine.scheduler.call(lambda q=q: floor(engine, q, rows, args.repeats, capture=gpu))
                    for q in (args.tokens, 1)]
    if not args.skip_decode:
        out["decode_tokens_per_s"] = {f"{n}_streams": decode(engine, prompt, modes, n, 16 if gpu else 12,
                                                             3 if gpu else 2)
                                      for n in (1, 8)}
    if gpu:
        engine.scheduler.runner.graph_mode = "captured"
        out["syncs"] = syncs(engine, prompt)
        static = engine.scheduler.runner.static
        out["engine_capture"] = None if static is None else {"captures": static.captures, "replays": static.replays,
                                                             "failed": static.failed}
    engine.close()
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
