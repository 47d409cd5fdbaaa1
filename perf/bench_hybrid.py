"""Exact prefix reuse on hybrid (attention + recurrent) models, measured as the seed's table is.

``python -m perf.bench_hybrid [--families lfm2 qwen3_next] [--lengths 8192 16384 32768] [--block 256]
[--chunks 128 256 512 1024] [--clients 8] [--turns 4] [--decode-tokens 32] [--device cuda] [--out DIR]``
``python -m perf.bench_hybrid --model qwen2.5-coder-0.5b --lengths 16384 --chunks --clients 0`` — the
same engine rows on a named model (the second seed's table on an attention-only model);
``--cases repeat --decode-rounds 0`` times one case only (two cold reads: 32K on a CPU).

Random models big enough to matter (no hub here): an **LFM2-style** model (12 layers: two
short-convolution layers then one attention layer, repeated; hidden 512) and a **Qwen3-Next-style**
one (12 layers: three gated-delta-net layers then one attention layer; hidden 512, 8 experts), on
the byte-level ChatML tokenizer (one token per byte of text). Everything runs through the engine
(``PromptCache.complete``), one process, 2 threads unless ``--threads``; on ``--device cuda`` in
the engine's default dtype there (bf16), the server loading the saved model the same way:

* **time to first token** of a document prompt of each length: reuse off; first pass with reuse on
  (it stores the blocks); the exact repeat; the same document with a new question; a middle
  edit, first request and repeated; the chat's second turn (the answer and a new question);
* **decode** tokens/s with reuse off and on (the same requests, ``--decode-rounds`` interleaved
  rounds, each other round in the other order, medians; on / off as the median of the per-round
  ratios);
* **cold read per chunk size**: reuse off at the first length, for each ``--chunks`` block size
  (the cost of reading in fixed chunks so that reuse resumes exactly);
* **server**: ``promptcache serve`` on the model, ``--clients`` clients each holding a
  ``--turns``-turn chat over its own document, requests/s with reuse on vs ``"cache": false``.

Every answer with reuse on is compared with the same request with reuse off (token ids, and first
logits bitwise in the engine; text through the server): the ``exact`` column. Writes
``hybrid.json`` and ``summary.md`` under ``--out`` (default ``perf/results/<machine>/hybrid``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from rich.progress import Progress

from pckernels.engine import PromptCache
from pckernels.engine.loading import default_dtype
from pckernels.prefix.testing import tiny_tokenizer
from perf.suite.runner import machine_name, peak_rss_gib

COMMON = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=65536)
FAMILIES = {
    "lfm2": dict(layer_types=["conv", "conv", "full_attention"] * 4, block_ff_dim=1536),
    "qwen3_next": dict(layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3, linear_num_value_heads=8,
                       linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=384, shared_expert_intermediate_size=384),
}
CASES = ("first pass", "repeat", "new question", "middle edit", "edit repeated", "second turn")
NEEDS = {case: "first pass" for case in CASES[1:]} | {"edit repeated": "middle edit"}
"""The case whose reuse-on request stores the blocks a case reads (run even when not timed)."""
WORDS = ("river", "bridge", "harbour", "tide", "lantern", "orchard", "market", "ledger", "furnace", "quarry")


def build(family: str, vocab: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=vocab, **{**COMMON, **FAMILIES[family]})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def document(length: int, seed: int = 0) -> str:
    parts, i = [], 0
    while sum(len(p) + 1 for p in parts) < length:
        parts.append(f"{WORDS[(i + seed) % 10]} {i * 37 % 1009} {WORDS[(i * 3 + seed) % 10]}.")
        i += 1
    return " ".join(parts)[:length]


def chat(doc: str, *turns: str) -> list[dict]:
    messages = [{"role": "system", "content": doc}]
    for index, text in enumerate(turns):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return messages


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.first_logits, b.first_logits)


def sized_document(tokenizer, length: int, seed: int = 0) -> str:
    """A :func:`document` of ``length`` tokens of ``tokenizer`` (one token per byte on the byte
    tokenizer; a model's BPE packs several bytes into a token)."""
    text = document(8 * length, seed)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:length]
    return tokenizer.decode(ids)


def decode_ratios(decode: dict) -> list[float]:
    """Decode rate with reuse on over off, per interleaved round: the machine's drift between rounds
    cancels in each pair, which a ratio of the two medians keeps."""
    rounds = decode.get("rounds", {})
    return [on / off for on, off in zip(rounds.get("on", []), rounds.get("off", [])) if off]


def ttft_table(engine: PromptCache, length: int, decode_tokens: int, rounds: int = 3,
               chosen: tuple[str, ...] = CASES) -> dict:
    """The seed's rows for one prompt length (module docstring); each length its own document, so no
    length reuses another's blocks. ``chosen``: the cases timed; a case they build on runs its
    reuse-on request only (a 32K cold read is minutes on a CPU). ``rounds`` 0: no decode rows."""
    needed = set(chosen)
    for case in chosen:
        while case in NEEDS:
            case = NEEDS[case]
            needed.add(case)
    doc = sized_document(engine.tokenizer, length, seed=length)
    middle = len(doc) // 2
    edited = doc[:middle] + "EDITED" + doc[middle + 6:]
    first = chat(doc, "Which ledger comes after the quarry?")
    cases = {
        "first pass": first, "repeat": first, "new question": chat(doc, "Name the first river."),
        "middle edit": chat(edited, "Which ledger comes after the quarry?"),
        "edit repeated": chat(edited, "Name the first river."),
    }
    row: dict = {"prompt_tokens": None, "cases": {}}
    answer = None
    for name in CASES:
        if name not in needed:
            continue
        messages = (cases[name] if name != "second turn" else
                    chat(doc, "Which ledger comes after the quarry?", answer, "And the one after that?"))
        timed = name in chosen
        off = engine.complete(messages, max_new_tokens=2, reuse=False) if timed else None
        on = engine.complete(messages, max_new_tokens=2)
        row["prompt_tokens"] = row["prompt_tokens"] or len(on.prompt_token_ids)
        if timed:
            row["cases"][name] = {"off_s": off.ttft_s, "on_s": on.ttft_s, "cached": on.cached_tokens,
                                  "exact": same(on, off)}
        if name == "first pass":
            answer = engine.tokenizer.decode(on.token_ids, skip_special_tokens=True) or "ok"
    if not rounds:
        return row
    rates: dict[str, list[float]] = {"off": [], "on": []}
    decoded = {}
    for index in range(rounds):
        for mode in ("off", "on") if index % 2 == 0 else ("on", "off"):  # neither always second
            result = engine.complete(first, max_new_tokens=decode_tokens, reuse=mode == "on")
            decoded[mode] = result
            if len(result.token_ids) > 1:
                rates[mode].append((len(result.token_ids) - 1) / max(result.total_s - result.ttft_s, 1e-9))
    row["decode"] = {mode: statistics.median(r) if r else None for mode, r in rates.items()}
    row["decode"]["rounds"] = {mode: r for mode, r in rates.items()}
    row["decode"]["tokens"] = len(decoded["on"].token_ids)
    row["decode"]["exact"] = decoded["on"].token_ids == decoded["off"].token_ids
    return row


def chunk_costs(model, tokenizer, length: int, chunks: list[int]) -> dict:
    """Cold read (reuse off) TTFT of one prompt per chunk (= block) size."""
    out = {}
    messages = chat(document(length), "Which ledger comes after the quarry?")
    for chunk in chunks:
        engine = PromptCache(model, tokenizer, prefix_block_size=chunk, kv_budget="16GiB")
        engine.complete(messages[:1] + [{"role": "user", "content": "warm"}], max_new_tokens=1, reuse=False)
        out[chunk] = min(engine.complete(messages, max_new_tokens=1, reuse=False).ttft_s for _ in range(1))
        engine.close()
    return out


def server_rates(model, tokenizer, clients: int, turns: int, length: int, block: int) -> dict:
    """Requests/s of ``clients`` chat clients (``turns`` turns each) against one server, reuse on and off."""
    import signal

    import openai

    from perf.server_load import start_server

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        proc, url = start_server(tmp, ["--prefix-block", str(block), "--served-model-name", "hybrid"])
        try:
            out = {}
            for mode in ("off", "on", "off", "on"):
                def talk(index: int) -> list[str]:
                    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
                    history = chat(document(length, seed=index + 1), "Which ledger comes after the quarry?")
                    answers = []
                    for turn in range(turns):
                        reply = client.chat.completions.create(model="hybrid", messages=history, max_tokens=8,
                                                               temperature=0, extra_body={"cache": mode == "on"})
                        text = reply.choices[0].message.content
                        answers.append(text)
                        history = history + [{"role": "assistant", "content": text},
                                             {"role": "user", "content": f"And then (turn {turn + 2})?"}]
                    return answers

                t0 = time.perf_counter()
                with ThreadPoolExecutor(clients) as pool:
                    answers = list(pool.map(talk, range(clients)))
                seconds = time.perf_counter() - t0
                rate = clients * turns / seconds
                best = out.get(mode)
                if best is None or rate > best["requests_per_s"]:
                    out[mode] = {"requests_per_s": rate, "seconds": seconds, "answers": answers}
            out["exact"] = out["on"]["answers"] == out["off"]["answers"]
            for mode in ("on", "off"):
                out[mode].pop("answers")
            return out
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def summary(results: dict) -> str:
    lines = [f"# Exact prefix reuse on long prompts ({results['machine']}, {results['threads']} threads, "
             f"{results.get('dtype', 'torch.float32')})", ""]
    for family, data in results["families"].items():
        lines += [f"## {family} ({data['params_m']:.0f}M parameters, {data['layers']})", "",
                  "| prompt | case | reuse off | reuse on | cached tokens | speed-up | exact |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for length, row in data["lengths"].items():
            for name, case in row["cases"].items():
                lines.append(f"| {row['prompt_tokens']} | {name} | {case['off_s']:.2f} s | {case['on_s'] * 1e3:.0f} ms | "
                             f"{case['cached']} | {case['off_s'] / max(case['on_s'], 1e-9):.1f}x | "
                             f"{'yes' if case['exact'] else 'NO'} |")
        decoded = [row for row in data["lengths"].values() if "decode" in row]
        if decoded:
            lines += ["", "| prompt | decode off (tok/s) | decode on (tok/s) | on / off per round, median (min–max) "
                          "| tokens | exact |", "|---|---:|---:|---:|---:|---|"]
        for row in decoded:
            d = row["decode"]
            ratios = decode_ratios(d)
            spread = (f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})" if ratios
                      else "n/a")
            lines.append(f"| {row['prompt_tokens']} | {d['off'] or 0:.1f} | {d['on'] or 0:.1f} | {spread} | "
                         f"{d['tokens']} | {'yes' if d['exact'] else 'NO'} |")
        if "peak_rss_gib" in data:
            lines.append(f"\nPeak resident memory of the process after {family}: {data['peak_rss_gib']:.1f} GiB"
                         + (f"; GPU memory allocated at most {data['peak_gpu_gib']:.1f} GiB" if "peak_gpu_gib" in data
                            else ""))
        if data.get("chunks"):
            lines += ["", f"Cold read of {data['chunk_tokens']} tokens by chunk size: " + ", ".join(
                f"{size}: {seconds:.2f} s" for size, seconds in data["chunks"].items())]
        if data.get("server"):
            s = data["server"]
            lines += ["", f"Server, {s['clients']} clients x {s['turns']}-turn chats over {s['tokens']}-token "
                          f"documents: reuse off {s['off']['requests_per_s']:.2f} req/s, reuse on "
                          f"{s['on']['requests_per_s']:.2f} req/s "
                          f"({s['on']['requests_per_s'] / s['off']['requests_per_s']:.1f}x); same answers: "
                          f"{'yes' if s['exact'] else 'NO'}"]
        lines.append("")
    return "\n".join(lines)


def save(out_dir: Path, results: dict, partial: tuple[str, dict] | None = None) -> None:
    """``hybrid.json`` and ``summary.md`` so far: a run cut short keeps every length it finished
    (``partial``: the family in progress and its data)."""
    if partial is not None:
        name, data = partial
        results = results | {"families": {**results["families"], name: data}, "partial": name}
    (out_dir / "hybrid.json").write_text(json.dumps(results, indent=1))
    (out_dir / "summary.md").write_text(summary(results))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_hybrid", description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--chunks", nargs="*", type=int, default=[128, 256, 512, 1024])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--server-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-rounds", type=int, default=3, help="0: no decode rows")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                    help="the cases timed at each length (a case they build on still stores its blocks)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the model in bf16 there)")
    ap.add_argument("--model", help="instead of the random hybrids, the same table on a named model "
                                    "(qwen2.5-coder-0.5b: the second seed's table on an attention-only model)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = default_dtype(device)
    out_dir = args.out or Path(__file__).resolve().parent / "results" / machine_name(device) / "hybrid"
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    results = {"machine": machine_name(device), "threads": args.threads, "block": args.block, "dtype": str(dtype),
               "torch": torch.__version__, "families": {}}
    subjects = [args.model] if args.model else args.families
    with Progress() as progress:
        task = progress.add_task("hybrid", total=len(subjects) * (len(args.lengths) + 2))
        for family in subjects:
            if args.model:
                engine = PromptCache.from_pretrained(args.model, device=device, store_dir=False,
                                                     prefix_block_size=args.block, kv_budget="16GiB")
                model, tokenizer, family = engine.model, engine.tokenizer, engine.name
            else:
                model = build(family, len(tokenizer), device, dtype)
                engine = PromptCache(model, tokenizer, prefix_block_size=args.block, kv_budget="16GiB")
            kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
            layers = ", ".join(f"{n} {t}" for t, n in sorted({t: kinds.count(t) for t in kinds}.items()))
            data = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "layers": layers, "lengths": {}}
            engine.complete(chat(sized_document(tokenizer, 2 * args.block), "warm up"), max_new_tokens=2, reuse=False)
            for length in args.lengths:
                progress.update(task, description=f"{family} {length}")
                data["lengths"][length] = ttft_table(engine, length, args.decode_tokens, args.decode_rounds,
                                                        tuple(args.cases))
                progress.advance(task)
                save(out_dir, results, partial=(family, data))
            engine.close()
            if args.chunks:
                progress.update(task, description=f"{family} chunk sizes")
                data["chunk_tokens"] = args.lengths[0]
                data["chunks"] = chunk_costs(model, tokenizer, args.lengths[0], args.chunks)
                save(out_dir, results, partial=(family, data))
            progress.advance(task)
            if args.clients:
                progress.update(task, description=f"{family} server")
                data["server"] = {"clients": args.clients, "turns": args.turns, "tokens": args.server_tokens,
                                  **server_rates(model, tokenizer, args.clients, args.turns, args.server_tokens,
                                                 args.block)}
            progress.advance(task)
            data["peak_rss_gib"] = peak_rss_gib()
            if device.type == "cuda":
                data["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            results["families"][family] = data
            save(out_dir, results)
    print(summary(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
