"""The suite's results as JSON and as a markdown summary (tables, targets, links to the plots)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def ms(summary: dict) -> str:
    """``median ms (min–max)``."""
    return f"{summary['median'] * 1e3:.0f} ms ({summary['min'] * 1e3:.0f}–{summary['max'] * 1e3:.0f})"


def kib(value: float | None) -> str:
    return "–" if value is None else f"{value / 1024:,.1f} KiB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def ttft_section(result: dict) -> list[str]:
    rows = [[str(r["tokens"]), ms(r["baseline"]), ms(r["cached"]), ms(r["cached_resident"]), ms(r["floor"]),
             f"{r['speedup']:.1f}x", f"{r['cached_over_floor']:.2f}", f"{r['resident_over_floor']:.2f}",
             f"{r['gap_s']:.2f} s"] for r in result["rows"]]
    return ["## 1. TTFT vs prompt length", "",
            "One document module of the given size and a question. *Prompt Cache*: the document's blocks "
            "are copied from the store into the KV arena on every query; *resident*: they are already "
            "there at their rows; *floor*: the forward of the question over the resident cache alone.", "",
            *_table(["prompt tokens", "no reuse", "Prompt Cache", "resident", "floor", "speed-up",
                     "PC / floor", "resident / floor", "gap"], rows), "",
            f"{result['rounds']} rounds. Speed-ups are ratios of medians; the ratios to the floor are medians of "
            "per-round ratios (each round runs every series back to back).", "", *breakdown_lines(result["rows"])]


BREAKDOWN_COLUMNS = ("model forward", "place blocks (store + copy)", "parse prompt", "attention bias")


def breakdown_lines(rows: list[dict]) -> list[str]:
    """Where the time of one profiled Prompt Cache query (blocks copied) goes, per length."""
    table = []
    for r in rows:
        b = r["breakdown"]
        parts = [b["components"].get(c, 0.0) for c in BREAKDOWN_COLUMNS]
        rest = b["total_s"] - sum(parts)
        table.append([str(r["tokens"]), f"{b['total_s'] * 1e3:.0f} ms",
                      *(f"{v * 1e3:.1f} ms ({v / b['total_s']:.0%})" for v in (*parts, rest))])
    top = rows[-1]["breakdown"]["top_calls"]
    calls = ", ".join(f"`{name}` {seconds * 1e3:.0f} ms" for name, seconds in top.items())
    return ["Where one profiled Prompt Cache query's time goes (cProfile; blocks copied):", "",
            *_table(["prompt tokens", "total", *BREAKDOWN_COLUMNS, "rest"], table), "",
            f"Heaviest calls at {rows[-1]['tokens']} tokens (self time): {calls}.", ""]


def workloads_section(result: dict) -> list[str]:
    rows = []
    for r in result["rows"]:
        out = r["outputs"]
        tokens = r["prompt_tokens"]
        rows.append([r["name"], r["description"], f"{min(tokens)}–{max(tokens)}", ms(r["no_reuse"]), ms(r["prefix"]),
                     ms(r["prompt_cache"]), f"{r['speedup_prefix']:.1f}x", f"{r['speedup_prompt_cache']:.1f}x",
                     f"{r['prompt_cache_over_prefix']:.1f}x", f"{r['prefix_cached_fraction']:.0%}",
                     f"{r['prompt_cache_cached_fraction']:.0%}",
                     f"{'yes' if out['prefix_equals_oracle'] else 'NO'} / "
                     f"{'yes' if out['prompt_cache_equals_oracle'] else 'NO'}",
                     f"{out['first_token_agreement']:.0%} / {out['token_agreement']:.0%}", r["prefix_can_help"]])
    lines = ["## 2. Workloads", "",
             "Median TTFT over the stream's queries after the first (the first finds nothing stored), all rounds; "
             "each round replays the stream on an empty prefix store.", "",
             *_table(["workload", "what", "prompt tokens", "no reuse", "prefix reuse", "Prompt Cache", "prefix x",
                      "PC x", "PC vs prefix (paired)", "prefix reused", "PC cached", "= own oracle (prefix / PC)",
                      "PC vs no reuse: 1st token / tokens", "can prefix reuse help?"], rows), "",
             "*Equal outputs* means each method equals its own oracle on every query: prefix reuse is bitwise equal "
             "to the same prefill without reuse (tokens and first-token logits); Prompt Cache generates the same "
             "greedy tokens as the reference forward with the same module-scoped attention. Prompt Cache and no reuse "
             "are different computations (modules are encoded without attending to each other, RAG passages keep "
             "their schema order): the last column is how often they agree (first token; greedy tokens before the "
             "first difference).", ""]
    for r in result["rows"]:
        check = r["checks"][1 if len(r["checks"]) > 1 else 0]
        lines.append(f"- {r['name']}, query 2 — Prompt Cache: “{check['prompt_cache_text'].strip()[:120]}”; "
                     f"no reuse: “{check['no_reuse_text'].strip()[:120]}”")
    return lines + [""]


def hit_ratio_section(result: dict) -> list[str]:
    rows = [[f"{r['cached_tokens'] / r['prompt_tokens']:.2f}", f"{r['cached_tokens']} / {r['computed_tokens']}",
             ms(r["no_reuse"]), ms(r["prefix"]), ms(r["prompt_cache"]), f"{r['speedup_prefix']:.1f}x",
             f"{r['speedup_prompt_cache']:.1f}x", f"{r['ideal']:.1f}x"] for r in result["rows"]]
    return ["## 3. Cache-hit ratio", "",
            "*ideal*: prompt tokens / computed tokens (time proportional to computed tokens).", "",
            *_table(["cached fraction", "cached / computed tokens", "no reuse", "prefix reuse", "Prompt Cache",
                     "prefix x", "PC x", "ideal"], rows), ""]


def amortisation_section(result: dict) -> list[str]:
    rows = [[str(r["module_tokens"]), ms(r["encode"]), ms(r["encode_forward"]), ms(r["no_reuse"]),
             ms(r["prompt_cache"]), f"{r['saving_per_query_s'] * 1e3:.0f} ms",
             "never" if math.isinf(r["break_even_reuses"]) else f"{r['break_even_reuses']:.2f}"]
            for r in result["rows"]]
    return ["## 4. Encoding amortisation", "",
            "*encode*: `add_schema` wall time (parse, tokenize, forward, store); *forward*: the encoding forward "
            "alone. Break-even = encode / (no reuse − Prompt Cache): queries after which the encoding has paid off.",
            "", *_table(["module tokens", "encode", "forward", "query, no reuse", "query, Prompt Cache",
                         "saving / query", "break-even reuses"], rows), ""]


def memory_section(result: dict) -> list[str]:
    rows = [[r["model"], str(r["layers"]), str(r["kv_heads"]), str(r["head_dim"]), kib(r["fp16_bytes_per_token"]),
             kib(r["fp32_bytes_per_token"]), r["note"]] for r in result["computed"]]
    m = result["measured"]
    return ["## 5. Memory per cached token", "",
            "Computed: 2 × layers × KV heads × head dim × bytes per element (configs in `perf/suite/memory.py`).", "",
            *_table(["model", "layers", "KV heads", "head dim", "fp16", "fp32", "attention"], rows), "",
            f"Measured here ({m['model']}, {m['dtype']}): computed {kib(m['computed_bytes_per_token'])}; module "
            f"store {kib(m['store_bytes_per_token'])} per token ({m['store_tokens']} tokens); KV arena "
            f"{kib(m['buffer_bytes_per_row'])} per row; exact prefix cache {kib(m['prefix_bytes_per_token'])} per "
            f"prompt token ({m['prefix_tokens']} tokens, including the prompt end's logits).", ""]


def decode_section(result: dict) -> list[str]:
    rates = result["tokens_per_s"]
    rows = [[name, f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})", str(result["generated_tokens"].get(name, ""))]
            for name, s in rates.items()]
    return ["## 6. Decode rate", "",
            f"{result['context_tokens']}-token context, up to {result['max_new_tokens']} greedy tokens; tokens after "
            "the first per second of decoding.", "",
            *_table(["method", "tokens / s", "tokens generated"], rows), "",
            f"Prompt Cache / no reuse: {result['prompt_cache_over_no_reuse']:.2f}; prefix reuse / no reuse: "
            f"{result['prefix_over_no_reuse']:.2f}.", ""]


def concurrency_section(result: dict) -> list[str]:
    rows = []
    for r in result["rows"]:
        b, o, kv = r["batched"], r["one_at_a_time"], r["kv"]
        rows.append([str(r["streams"]), str(r["requests"]),
                     f"{b['tokens_per_s']['median']:.1f}", f"{o['tokens_per_s']['median']:.1f}",
                     f"{r['throughput_ratio']:.2f}x",
                     f"{b['ttft_p50_s'] * 1e3:.0f} / {b['ttft_p99_s'] * 1e3:.0f} ms",
                     f"{o['ttft_p50_s'] * 1e3:.0f} / {o['ttft_p99_s'] * 1e3:.0f} ms",
                     f"{kv['rows']} ({kv['over_distinct_modules']:.2f}x)" if kv["over_distinct_modules"] else "",
                     f"{kv['private_over_distinct']:.2f}x" if kv["private_over_distinct"] else "",
                     ("yes" if r["answers_equal_alone"] else f"NO ({r['mismatched_answers']})")
                     + f", {r['first_logits_max_abs_diff']:.1e}"])
    return ["## 7. Concurrent streams", "",
            f"{result['workload']}; each client sends its requests back to back, {result['rows'][0]['max_new_tokens']} "
            "greedy tokens each. *batched*: the scheduler as shipped; *one at a time*: `max_batch = 1` (requests "
            "queue). Aggregate tokens/s = all generated tokens over the round's wall time; TTFT from each "
            "request's arrival. KV: the arena's rows in use at its busiest moment and their ratio to the rows of "
            "the distinct modules the running requests import; *private* is what one copy of its modules per "
            "request would take instead.", "",
            *_table(["streams", "requests", "batched tok/s", "one at a time tok/s", "ratio", "TTFT p50/p99 batched",
                     "TTFT p50/p99 one at a time", "KV rows at peak (/ distinct modules)", "private copies",
                     "answers = alone, first-logit max diff"], rows), ""]


def llamacpp_section(result: dict) -> list[str]:
    if result.get("skipped"):
        return ["## 8. llama.cpp, the CPU peer", "", f"Skipped: {result['skipped']}", ""]
    quant = next((label for label in result.get("weights", {}) if label != "f32"), "q4_1").upper()
    lines = ["## 8. llama.cpp, the CPU peer", "",
             f"llama-cpp-python {result['llama_cpp_python']}, {result['threads']} threads each; the same token ids; "
             f"llama.cpp on the model's GGUF weights as F32 with its default F16 KV cache, with an F32 KV "
             f"cache (`kv f32`, promptcache's KV precision) and, if asked, flash attention (`fa`), and as the "
             f"quantized file ({quant}); promptcache with {result['promptcache_matmul']} matmuls. *hit*: a new question "
             "(the tokens after the document) over the cached document — llama.cpp keeps its longest cached "
             "prefix; promptcache imports the document as a module, or `complete()` reuses its prefix blocks.", ""]
    for c in result["contexts"]:
        names = sorted({n.split("/", 1)[1] for n in c["seconds"]} | set(c["decode_tokens_per_s"]))
        rows = []
        for name in names:
            cold = c["seconds"].get(f"cold/{name}")
            hit = c["seconds"].get(f"hit/{name}")
            rate = c["decode_tokens_per_s"].get(name)
            rows.append([name, f"{cold['median']:.2f} s" if cold else "–", ms(hit) if hit else "–",
                         f"{rate['median']:.1f} ({rate['min']:.1f}–{rate['max']:.1f})" if rate else "–"])
        lines += [f"### {c['context_tokens']}-token prompt, {c['question_tokens']} new tokens per question", "",
                  *_table(["engine", "cold prefill", "hit TTFT", "decode tok/s"], rows), "",
                  f"promptcache's prefix reuse recomputes {c['prefix_recomputed_tokens']} tokens per hit (resuming "
                  f"at a block: the tail after the last full block plus the question; at a token: the "
                  f"question); first tokens agree across engines in "
                  f"{c['first_token_agrees']} of {c['rounds']} rounds.", ""]
    if result.get("no_repack"):
        lines += [f"{', '.join(result['no_repack'])}: with weight repacking off (llama.cpp's `--no-repack`) — "
                  f"its repacked (AMX) kernels died of an illegal instruction on this CPU.", ""]
    for label, why in result.get("failed", {}).items():
        lines += [f"{label}: left out — {why}.", ""]
    return lines


SECTIONS = {"ttft": ttft_section, "workloads": workloads_section, "hit_ratio": hit_ratio_section,
            "amortisation": amortisation_section, "memory": memory_section, "decode": decode_section,
            "concurrency": concurrency_section, "llamacpp": llamacpp_section}


def targets(results: dict) -> list[str]:
    lines = []
    experiments = results["experiments"]
    if "ttft" in experiments:
        worst = max(experiments["ttft"]["rows"], key=lambda r: r["cached_over_floor"])
        worst_resident = max(experiments["ttft"]["rows"], key=lambda r: r["resident_over_floor"])
        lines.append(f"- Prompt Cache within 15% of the floor at every length: "
                     f"{'met' if experiments['ttft']['within_15pct_of_floor'] else 'NOT met'} with blocks copied "
                     f"(worst {worst['cached_over_floor']:.2f}x at {worst['tokens']} tokens); "
                     f"{'met' if experiments['ttft']['resident_within_15pct_of_floor'] else 'NOT met'} with blocks "
                     f"resident (worst {worst_resident['resident_over_floor']:.2f}x at {worst_resident['tokens']}).")
    if "workloads" in experiments:
        w = experiments["workloads"]
        lines.append(f"- k-of-N RAG ≥ 10x faster than exact prefix reuse at equal outputs: "
                     f"{'met' if w['rag_target_met'] else 'NOT met'} ({w['rag_prompt_cache_over_prefix']:.1f}x).")
    if "concurrency" in experiments and experiments["concurrency"]["throughput_at_8"] is not None:
        c = experiments["concurrency"]
        lines.append(f"- ≥ 4x aggregate tokens/s at 8 streams over the same requests one at a time: "
                     f"{'met' if c['throughput_at_8'] >= 4 else 'NOT met'} ({c['throughput_at_8']:.2f}x); KV at 8 "
                     f"streams ≤ 1.2x their distinct modules: "
                     f"{'met' if (c['kv_at_8_over_distinct_modules'] or 99) <= 1.2 else 'NOT met'} "
                     f"({c['kv_at_8_over_distinct_modules']:.2f}x).")
    return lines


def markdown(results: dict, plots: list[Path]) -> str:
    env, cfg = results["environment"], results["config"]
    load = env.get("load_average", {})
    lines = [f"# promptcache performance suite — {env['machine']} ({cfg['name']})", "",
             f"{env['model']} ({env['dtype']}) on {env['device']}, {env['threads']} threads, {env['cpu']}; "
             f"torch {env['torch']}, transformers {env['transformers']}; {cfg['repeats']} interleaved rounds per "
             f"measurement, median (min–max). {env['started']}, {results['elapsed_s']:.0f} s ("
             + ", ".join(f"{name} {s:.0f} s" for name, s in results.get("seconds", {}).items()) + ").", "",
             f"Command: `{env['command']}`", ""]
    if env.get("isa") and str(env.get("device", "cpu")).startswith("cpu"):
        path = env.get("native_cpu_path")
        lines += [f"CPU ISA: {env['isa']['summary']}"
                  + (f"; native forward's CPU path `{path}`." if path else "; HF's forward (no native one)."), ""]
    if env.get("peak_rss_gib"):
        lines += [f"Peak resident memory of the process: {env['peak_rss_gib']:.2f} GiB.", ""]
    if load:
        lines += [f"Load average (1 min) at start / end: {load['start']:.1f} / {load['end']:.1f} on "
                  f"{env['cores']} cores{' — the machine was busy; treat timings as noisy' if load['busy'] else ''}.",
                  ""]
    resumed = results.get("resumed")
    if resumed and resumed["experiments"]:
        lines += [f"Resumed: {', '.join(resumed['experiments'])} from the interrupted run started "
                  f"{resumed['environment']['started']} (same settings).", ""]
    lines += ["## Targets", "", *targets(results), ""]
    if plots:
        lines += [f"![overview]({plots[0].name})", ""]
    for name, section in SECTIONS.items():
        if name in results["experiments"]:
            lines += section(results["experiments"][name])
    return "\n".join(lines)


def write(results: dict, out_dir: Path, plots: list[Path]) -> Path:
    """``suite.json`` and ``summary.md`` in ``out_dir``; returns the summary's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "suite.json").write_text(json.dumps(results, indent=1, default=str))
    summary = out_dir / "summary.md"
    summary.write_text(markdown(results, plots))
    return summary
