"""PNG plots of the suite's results: one panel per experiment, drawn into given matplotlib axes,
an overview figure with all panels and one file per panel."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

log = logging.getLogger(__name__)

COLORS = {"baseline": "#d62728", "no_reuse": "#d62728", "prefix": "#ff7f0e", "cached": "#1f77b4",
          "prompt_cache": "#1f77b4", "cached_resident": "#17becf", "floor": "#2ca02c",
          "cached_host": "#9467bd"}
LABELS = {"no_reuse": "no reuse", "prefix": "exact prefix reuse", "prompt_cache": "Prompt Cache"}


def _ms(summary: dict) -> tuple[float, float, float]:
    """Median and the distances to min and max, in milliseconds (for error bars)."""
    med = summary["median"] * 1e3
    return med, med - summary["min"] * 1e3, summary["max"] * 1e3 - med


def ttft_panel(ax, result: dict) -> None:
    rows = result["rows"]
    x = [r["tokens"] for r in rows]
    for series, label in result["series"].items():
        med, lo, hi = zip(*(_ms(r[series]) for r in rows))
        ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, color=COLORS.get(series), label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(t) for t in x])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT vs prompt length")
    ax.legend(fontsize=7)


def workloads_panel(ax, result: dict) -> None:
    rows = result["rows"]
    methods = ("no_reuse", "prefix", "prompt_cache")
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        med, lo, hi = zip(*(_ms(r[method]) for r in rows))
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, color=COLORS[method], label=LABELS[method])
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title("Workloads")
    ax.legend(fontsize=7)


def hit_ratio_panel(ax, result: dict) -> None:
    rows = result["rows"]
    x = [r["cached_tokens"] / r["prompt_tokens"] for r in rows]
    for method in ("no_reuse", "prefix", "prompt_cache"):
        med, lo, hi = zip(*(_ms(r[method]) for r in rows))
        ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, color=COLORS[method], label=LABELS[method])
    ax.set_yscale("log")
    ax.set_xlabel(f"cached fraction of a {rows[0]['prompt_tokens']}-token prompt")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Cache-hit ratio")
    ax.legend(fontsize=7)


def amortisation_panel(ax, result: dict, max_queries: int = 8) -> None:
    queries = list(range(max_queries + 1))
    for row in result["rows"]:
        encode, base, cached = row["encode"]["median"], row["no_reuse"]["median"], row["prompt_cache"]["median"]
        line = ax.plot(queries, [q * base for q in queries], linestyle="--")[0]
        ax.plot(queries, [encode + q * cached for q in queries], color=line.get_color(),
                label=f"{row['module_tokens']} tokens (break-even {row['break_even_reuses']:.2f})")
    ax.set_xlabel("queries")
    ax.set_ylabel("cumulative seconds (dashed: no reuse)")
    ax.set_title("Encoding amortisation")
    ax.legend(fontsize=7)


def memory_panel(ax, result: dict) -> None:
    rows = result["computed"]
    ax.barh([r["model"] for r in rows], [r["fp16_bytes_per_token"] / 1024 for r in rows], color="#9467bd")
    measured = result["measured"]
    if measured.get("store_bytes_per_token"):
        ax.barh([f"{measured['model']} measured ({measured['dtype'].replace('torch.', '')})"],
                [measured["store_bytes_per_token"] / 1024], color="#8c564b")
    ax.set_xscale("log")
    ax.set_xlabel("KiB per cached token (fp16 unless noted)")
    ax.set_title("Memory per token")
    ax.tick_params(axis="y", labelsize=7)


def decode_panel(ax, result: dict) -> None:
    rates = result["tokens_per_s"]
    methods = list(rates)
    med = [rates[m]["median"] for m in methods]
    err = [[rates[m]["median"] - rates[m]["min"] for m in methods],
           [rates[m]["max"] - rates[m]["median"] for m in methods]]
    ax.bar([LABELS[m] for m in methods], med, yerr=err, capsize=3, color=[COLORS[m] for m in methods])
    ax.set_ylabel("decoded tokens / s")
    ax.set_title(f"Decode rate ({result['context_tokens']}-token context)")
    ax.tick_params(axis="x", labelsize=7)


def concurrency_panel(ax, result: dict) -> None:
    rows = result["rows"]
    x = [r["streams"] for r in rows]
    for method, color, label in (("batched", COLORS["prompt_cache"], "batched (scheduler)"),
                                 ("one_at_a_time", COLORS["no_reuse"], "one at a time")):
        med = [r[method]["tokens_per_s"]["median"] for r in rows]
        lo = [m - r[method]["tokens_per_s"]["min"] for m, r in zip(med, rows)]
        hi = [r[method]["tokens_per_s"]["max"] - m for m, r in zip(med, rows)]
        ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(s) for s in x])
    ax.minorticks_off()
    ax.set_xlabel("concurrent streams (RAG k of N)")
    ax.set_ylabel("aggregate tokens / s")
    ax.set_title("Concurrent streams")
    ttft = ax.twinx()
    ttft.plot(x, [r["batched"]["ttft_p99_s"] * 1e3 for r in rows], linestyle=":", color=COLORS["prompt_cache"])
    ttft.plot(x, [r["one_at_a_time"]["ttft_p99_s"] * 1e3 for r in rows], linestyle=":", color=COLORS["no_reuse"])
    ttft.set_ylabel("TTFT p99 (ms, dotted)")
    ax.legend(fontsize=7, loc="upper left")


def llamacpp_panel(ax, result: dict) -> None:
    """TTFT of a few new tokens after a cached document, per engine set-up and context size."""
    contexts = result["contexts"]
    names = [n for n in contexts[0]["seconds"] if n.startswith("hit/")]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        med, lo, hi = zip(*(_ms(c["seconds"][name]) for c in contexts))
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(contexts))]
        color = COLORS["prompt_cache"] if "promptcache" in name else None
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=name[4:], color=color,
               alpha=1.0 if "module" in name or "llama" in name else 0.6)
    ax.set_xticks(range(len(contexts)), [f"{c['context_tokens']} tokens" for c in contexts])
    ax.set_ylabel("TTFT after a cached document (ms)")
    ax.set_title("vs llama.cpp (same weights, same token ids)")
    ax.legend(fontsize=6)


def _present(results: dict) -> list[str]:
    return [name for name in PANELS if name in results["experiments"]
            and not results["experiments"][name].get("skipped")]


PANELS = {"ttft": ttft_panel, "workloads": workloads_panel, "hit_ratio": hit_ratio_panel,
          "amortisation": amortisation_panel, "memory": memory_panel, "decode": decode_panel,
          "concurrency": concurrency_panel, "llamacpp": llamacpp_panel}


def write_plots(results: dict, out_dir: Path, title: str) -> list[Path]:
    """``overview.png`` with every experiment present plus ``<experiment>.png`` each."""
    present = _present(results)
    written = []
    if not present:
        return written
    columns = min(3, len(present))
    rows = -(-len(present) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.5 * rows), squeeze=False)
    for ax, name in zip(axes.flat, present):
        PANELS[name](ax, results["experiments"][name])
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "overview.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    for name in present:
        fig, ax = plt.subplots(figsize=(7, 4.8))
        PANELS[name](ax, results["experiments"][name])
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    log.info("wrote %d plots to %s", len(written), out_dir)
    return written
