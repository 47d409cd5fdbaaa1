"""Fidelity evaluation: does modular reuse keep answers right, and what restores them?

Every question is answered under each condition on the same prompt tokens:

* ``baseline``: plain causal prefill, contiguous positions (what you get without promptcache);
* ``prefix``: exact prefix reuse (``PrefixCache``) of the same token ids; equal to baseline by
  construction up to the chunked prefill's float rounding;
* ``independent``: Prompt Cache, each document encoded on its own (the paper);
* ``scaffold`` (cross-document questions): the two documents the question needs encoded jointly;
* ``first@s`` / ``deviation@s``: independent modules with a share ``s`` of the stale module
  tokens recomputed over the assembled cache (``PromptCache.generate(recompute=...)``);
  ``epic@k``: the first ``k`` stale tokens of every module (EPIC);
* ``compact``, ``compact+<policy>@<amount>``: the same at compact placement (modules laid out
  contiguously, keys re-rotated: ``docs/pml.md``); ``schema+...`` names schema placement.

``--data heldout`` reads the held-out set (``heldout/``), ``--layout library`` one schema of every
document with each question importing its documents and a distractor (``dataset.py``);
``--conditions`` lists the conditions to run by name.

Scores per condition and question kind: exact match, token F1, answer recall ("contains"),
greedy agreement with baseline (identical generated tokens), first-token agreement, mean KL
divergence of the first-token distribution from baseline's, TTFT and computed tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from perf.fidelity import dataset as ds
from perf.fidelity.scoring import contains_answer, exact_match, first_token_kl, token_f1

RESULTS_ROOT = Path(__file__).resolve().parents[1] / "results"
DEFAULT_SHARES = (0.1, 0.25, 0.5, 1.0)
DEFAULT_POLICIES = ("first", "deviation")
ALL_POLICIES = ("first", "deviation", "epic")
LAYOUTS = ("bundle", "library")
KINDS = ("single", "cross")


@dataclass(frozen=True)
class Condition:
    name: str
    kind: str
    """``baseline``, ``prefix``, ``independent``, ``scaffold`` or ``recompute``."""
    share: float = 0.0
    policy: str = ""
    placement: str = "schema"

    def applies_to(self, question: ds.Question, layout: str = "bundle") -> bool:
        return self.kind != "scaffold" or (question.kind == "cross" and layout == "bundle")


def parse_condition(name: str) -> Condition:
    """A condition from its name: ``baseline``, ``prefix``, ``scaffold``, ``independent`` (or
    ``schema``), ``compact``, and ``[schema+|compact+]<policy>@<amount>`` (``first@0.1``,
    ``compact+epic@4``)."""
    if name in ("baseline", "prefix", "scaffold"):
        return Condition(name, name)
    if name in ("independent", "schema", "compact"):
        return Condition(name, "independent", placement="compact" if name == "compact" else "schema")
    placement, _, rest = name.rpartition("+")
    policy, _, amount = rest.partition("@")
    if placement not in ("", "schema", "compact") or policy not in ALL_POLICIES or not amount:
        raise ValueError(f"unknown condition {name!r}: expected baseline, prefix, scaffold, independent, compact or "
                         f"[schema+|compact+]<{'|'.join(ALL_POLICIES)}>@<amount>")
    return Condition(name, "recompute", float(amount), policy, placement or "schema")


def conditions(shares: tuple[float, ...], policies: tuple[str, ...]) -> list[Condition]:
    """The conditions in run order; share 1 runs once (every policy recomputes all stale tokens)."""
    out = [Condition("baseline", "baseline"), Condition("prefix", "prefix"),
           Condition("independent", "independent"), Condition("scaffold", "scaffold")]
    for policy in policies:
        for share in shares:
            if share >= 1.0 and policy != policies[0]:
                continue
            out.append(Condition(f"{policy}@{share:g}", "recompute", share, policy))
    return out


@dataclass
class Record:
    question: str
    kind: str
    condition: str
    text: str
    em: float
    f1: float
    contains: float
    ttft_s: float
    computed_tokens: int
    agree: float = 1.0
    first_agree: float = 1.0
    kl: float = 0.0
    extra: dict = field(default_factory=dict)


def probe_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The arguments every fidelity probe takes: ``--data``, ``--layout``, ``--limit``,
    ``--threads`` and ``--out``; a probe adds its own."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--data", default="shipped")
    ap.add_argument("--layout", default="library", choices=("bundle", "library"))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    return ap


def open_probe(args: argparse.Namespace):
    """``(dataset, PromptCache of the embedded model, questions)`` for a probe's parsed ``args``."""
    from pckernels import PromptCache

    torch.set_num_threads(args.threads)
    data = ds.load(args.data)
    cache = PromptCache.from_pretrained(store_dir=False, device_budget="8GiB")
    return data, cache, select_questions(data, args.limit)


def write_probe(args: argparse.Namespace, summary: dict, **detail) -> int:
    """Write a probe's ``{"settings", "summary", **detail}`` to ``args.out`` and print the summary."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                    **detail}, indent=1), encoding="utf-8")
    print(json.dumps(summary, indent=1))
    return 0


def select_questions(data: ds.Dataset, limit: int | None) -> list[ds.Question]:
    """All questions, or ``limit`` of each kind spread evenly over the set, interleaved (one
    question of each kind and bundle in turn) so that any prefix of the run is a spread too."""
    chosen: list[ds.Question] = []
    for kind in KINDS:
        pool = [q for q in data.questions if q.kind == kind]
        if limit is not None and limit < len(pool):
            pool = [pool[round(i * len(pool) / limit)] for i in range(limit)]
        chosen += pool
    rank: dict[str, int] = {}
    seen: dict[tuple[str, int], int] = {}
    for q in chosen:
        group = (q.kind, data.bundle_of(q))
        rank[q.id] = seen.get(group, 0)
        seen[group] = rank[q.id] + 1
    return sorted(chosen, key=lambda q: (rank[q.id], data.bundle_of(q), KINDS.index(q.kind)))


def _machine() -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"{device}-{platform.machine()}-{torch.get_num_threads()}t"


def evaluate(args: argparse.Namespace, checkpoint=None) -> dict:
    """Run the evaluation; returns the report (summary, per-question records, settings).
    ``checkpoint(report)``, if given, receives the report so far after every question."""
    from pckernels import PromptCache
    from pckernels.prefix import PrefixCache

    torch.set_num_threads(args.threads)
    data = ds.load(getattr(args, "data", None) or "shipped")
    layout = getattr(args, "layout", None) or "bundle"
    questions = select_questions(data, args.limit)
    named = getattr(args, "conditions", None)
    conds = ([parse_condition(n) for n in named] if named
             else conditions(tuple(args.shares), tuple(args.policies)))
    if conds[0].kind != "baseline":
        conds.insert(0, Condition("baseline", "baseline"))
    placements = sorted({c.placement for c in conds if c.kind in ("independent", "recompute")} | {"schema"})
    stop = ["\n", ". "]
    t0 = time.perf_counter()
    cache = PromptCache.from_pretrained(args.model, store_dir=False, device_budget="8GiB")
    prefix = PrefixCache(cache.model, cache.tokenizer)
    print(f"loaded {cache.name} in {time.perf_counter() - t0:.1f} s; {len(questions)} questions, "
          f"{len(conds)} conditions", flush=True)

    setup: dict[str, float] = {}

    def add_schema(text: str, deviation: bool = False) -> None:
        """Encode a schema (and its deviation scores) once, outside any timed generation."""
        t0 = time.perf_counter()
        schema = cache.add_schema(text)
        if deviation:
            cache.deviation.for_schema(schema)
        setup.setdefault(schema.name, time.perf_counter() - t0)

    needs_deviation = any(c.policy == "deviation" for c in conds)

    def add_question_schemas(question: ds.Question) -> None:
        if layout == "library":
            add_schema(ds.library_schema(data), needs_deviation)
            return
        add_schema(ds.bundle_schema(data, data.bundle_of(question)), needs_deviation)
        if question.kind == "cross" and any(c.kind == "scaffold" for c in conds):
            add_schema(ds.bundle_schema(data, data.bundle_of(question), question.docs))

    add_question_schemas(questions[0])
    if "compact" in placements:
        t1 = time.perf_counter()
        for name, schema in list(cache.schemas.items()):
            cache.encoder.encode_schema(schema, geometries=("packed",))
            setup[name] = setup.get(name, 0.0) + time.perf_counter() - t1
    for placement in placements:
        warm = ds.prompt(data, questions[0], layout=layout, placement=placement)
        for mode in ("baseline", "cached"):
            cache.generate(warm, mode=mode, max_new_tokens=2)

    def report(done: int) -> dict:
        return {
            "settings": {"model": cache.name, "machine": args.machine, "threads": args.threads,
                         "questions": done, "planned_questions": len(questions), "limit": args.limit,
                         "max_new_tokens": args.max_new_tokens, "shares": list(args.shares),
                         "policies": list(args.policies), "stop": stop, "torch": torch.__version__,
                         "data": data.name, "layout": layout, "conditions": [c.name for c in conds],
                         "python": platform.python_version()},
            "setup_s": setup,
            "summary": summarize(records, conds),
            "records": [r.__dict__ for r in records],
        }

    records: list[Record] = []
    for number, question in enumerate(questions, 1):
        add_question_schemas(question)
        resolved = {p: cache.resolve(ds.prompt(data, question, layout=layout, placement=p)) for p in placements}
        if any(r.token_ids != resolved["schema"].token_ids for r in resolved.values()):
            raise RuntimeError(f"{question.id}: the placements read different tokens")
        info = question_info(data, question, resolved["schema"], layout)
        base_result = None
        for cond in conds:
            if not cond.applies_to(question, layout):
                continue
            result = _generate(cache, prefix, data, question, resolved, cond, args.max_new_tokens, stop)
            if cond.kind == "scaffold" and result.prompt_token_ids != list(resolved["schema"].token_ids):
                raise RuntimeError(f"{question.id}: the scaffold prompt reads different tokens")
            record = Record(question.id, question.kind, cond.name, result.text,
                            exact_match(result.text, question.answers), token_f1(result.text, question.answers),
                            contains_answer(result.text, question.answers), result.ttft_s, result.computed_tokens,
                            extra=dict(info))
            if base_result is None:
                base_result = result
            else:
                record.agree = float(result.token_ids == base_result.token_ids)
                record.first_agree = float(result.token_ids[0] == base_result.token_ids[0])
                record.kl = first_token_kl(base_result.first_logits, result.first_logits)
                if cond.kind == "prefix":
                    record.extra["max_abs_logit_diff"] = float(
                        (result.first_logits - base_result.first_logits).abs().max())
            records.append(record)
        line = "  ".join(f"{r.condition}={r.contains:.0f}" for r in records if r.question == question.id)
        print(f"[{number}/{len(questions)}] {question.id} {line} | baseline: {base_result.text!r}", flush=True)
        if checkpoint is not None:
            checkpoint(report(number))
    return report(len(questions))


def question_info(data: ds.Dataset, question: ds.Question, resolved, layout: str) -> dict:
    """Where the question's documents sit: the imported documents in order, the index of the one
    holding the answer, and (schema placement) the positions between the end of the system
    prompt and that document's first token."""
    docs = list(ds.imported(data, question, layout))
    answer = question.docs[-1]
    schema = resolved.schema
    head = [p for p in schema.modules[""].position_ids if p < schema.modules[answer].start]
    return {"imported": docs, "answer_index": docs.index(answer),
            "schema_gap": schema.modules[answer].start - (head[-1] + 1 if head else 0)}


def _generate(cache, prefix, data, question, resolved, cond: Condition, max_new_tokens: int, stop):
    plain = resolved["schema"]
    if cond.kind == "baseline":
        return cache.generate(plain, mode="baseline", max_new_tokens=max_new_tokens, stop=stop)
    if cond.kind == "prefix":
        return prefix.complete(list(plain.token_ids), max_new_tokens=max_new_tokens, stop=stop)
    if cond.kind == "scaffold":
        return cache.generate(ds.prompt(data, question, scaffold=True), max_new_tokens=max_new_tokens, stop=stop)
    amount = int(cond.share) if cond.policy == "epic" else cond.share
    return cache.generate(resolved[cond.placement], max_new_tokens=max_new_tokens, stop=stop, recompute=amount,
                          recompute_policy=cond.policy or "first")


def summarize(records: list[Record], conds: list[Condition]) -> dict:
    """``{kind: {condition: metrics}}`` for ``single``, ``cross`` and ``all``."""
    out: dict[str, dict] = {}
    for kind in (*KINDS, "all"):
        rows = {}
        for cond in conds:
            chosen = [r for r in records if r.condition == cond.name and (kind == "all" or r.kind == kind)]
            if not chosen:
                continue
            rows[cond.name] = {
                "n": len(chosen),
                "share": cond.share, "policy": cond.policy, "type": cond.kind, "placement": cond.placement,
                "em": 100 * statistics.fmean(r.em for r in chosen),
                "f1": 100 * statistics.fmean(r.f1 for r in chosen),
                "contains": 100 * statistics.fmean(r.contains for r in chosen),
                "agree": 100 * statistics.fmean(r.agree for r in chosen),
                "first_agree": 100 * statistics.fmean(r.first_agree for r in chosen),
                "kl": statistics.fmean(r.kl for r in chosen),
                "ttft_median_ms": 1e3 * statistics.median(r.ttft_s for r in chosen),
                "ttft_mean_ms": 1e3 * statistics.fmean(r.ttft_s for r in chosen),
                "computed_tokens": statistics.fmean(r.computed_tokens for r in chosen),
            }
        out[kind] = rows
    return out


def paired_changes(records: list[dict]) -> dict[str, dict[str, dict[str, int]]]:
    """``{kind: {condition: {"lost": n, "gained": n}}}``: questions whose answer baseline
    contained and the condition did not (lost), and the reverse (gained). With a few dozen
    questions a kind, this pairing separates a real change from noise better than the
    difference of two accuracies does."""
    base = {r["question"]: r["contains"] for r in records if r["condition"] == "baseline"}
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in records:
        if r["question"] not in base:
            continue
        for kind in (r["kind"], "all"):
            counts = out.setdefault(kind, {}).setdefault(r["condition"], {"lost": 0, "gained": 0})
            counts["lost"] += int(base[r["question"]] > r["contains"])
            counts["gained"] += int(base[r["question"]] < r["contains"])
    return out


def markdown(report: dict) -> str:
    s = report["settings"]
    planned = s.get("planned_questions", s["questions"])
    done = "" if planned == s["questions"] else f" (of {planned} planned; the run was stopped early)"
    lines = [f"# Fidelity: {s['model']} on {s['machine']}", "",
             f"{s['questions']} questions{done} (limit {s['limit']}), greedy, up to {s['max_new_tokens']} new tokens, "
             f"stop at a newline or the end of the first sentence. EM / F1 / contains in %; "
             f"agree: identical generated tokens as baseline; "
             f"first: same first token; KL: mean KL(baseline || condition) of the first-token distribution "
             f"(nats); lost / gained: questions whose answer baseline contained and this condition did not, "
             f"and the reverse; TTFT median; computed: prompt tokens computed per question.", ""]
    changes = paired_changes(report["records"])
    for kind in (*KINDS, "all"):
        rows = report["summary"].get(kind, {})
        if not rows:
            continue
        lines += [f"## {kind} ({next(iter(rows.values()))['n']} questions)", "",
                  "| condition | EM | F1 | contains | lost / gained | agree | first | KL | TTFT ms | computed |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, m in rows.items():
            change = changes.get(kind, {}).get(name, {"lost": 0, "gained": 0})
            lines.append(f"| {name} | {m['em']:.1f} | {m['f1']:.1f} | {m['contains']:.1f} | "
                         f"{change['lost']} / {change['gained']} | {m['agree']:.1f} | "
                         f"{m['first_agree']:.1f} | {m['kl']:.3f} | {m['ttft_median_ms']:.0f} | "
                         f"{m['computed_tokens']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Per question kind: answer accuracy ("contains") against median TTFT (noisy on a shared
    CPU) and against prompt tokens computed (deterministic), and the first-token KL from
    baseline against TTFT (the sharper signal on a few dozen questions); recompute sweeps as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if report["summary"].get(k)]
    panels = (("ttft_median_ms", "median TTFT (ms, log)", "contains", "answer contained (%)"),
              ("computed_tokens", "prompt tokens computed (log)", "contains", "answer contained (%)"),
              ("ttft_median_ms", "median TTFT (ms, log)", "kl", "first-token KL from baseline (nats, symlog)"))
    fig, axes = plt.subplots(len(panels), len(kinds), figsize=(6.5 * len(kinds), 13), squeeze=False)
    markers = {"baseline": ("k", "s"), "prefix": ("tab:gray", "D"), "independent": ("tab:red", "o"),
               "compact": ("tab:orange", "^"), "scaffold": ("tab:green", "*")}
    for row, (x_key, x_label, y_key, y_label) in enumerate(panels):
        for ax, kind in zip(axes[row], kinds):
            rows = report["summary"][kind]
            for name, (colour, marker) in markers.items():
                if name in rows:
                    ax.scatter(rows[name][x_key], rows[name][y_key], c=colour, marker=marker, s=80,
                               label=name, zorder=3)
            for placement, start, style in (("schema", "independent", "-o"), ("compact", "compact", "--^")):
                for policy, colour in (("first", "tab:blue"), ("deviation", "tab:purple"), ("epic", "tab:olive")):
                    sweep = sorted(((m["share"], m) for m in rows.values() if m["policy"] == policy
                                    and m.get("placement", "schema") == placement), key=lambda t: t[0])
                    if policy == "deviation" and placement == "schema" and "first@1" in rows:
                        sweep.append((1.0, rows["first@1"]))
                    if not sweep:
                        continue
                    points = ([(0.0, rows[start])] if start in rows else []) + sweep
                    ax.plot([m[x_key] for _, m in points], [m[y_key] for _, m in points], style, c=colour,
                            label=f"{placement}: recompute {policy}")
                    for share, m in sweep:
                        ax.annotate(f"{share:g}", (m[x_key], m[y_key]), textcoords="offset points",
                                    xytext=(4, -10), fontsize=8, color=colour)
            ax.set_xscale("log")
            if y_key == "kl":
                ax.set_yscale("symlog", linthresh=1e-3)
                ax.set_ylim(bottom=0)
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.set_title(f"{kind}-document questions (n={next(iter(rows.values()))['n']})")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"Fidelity vs cost, {report['settings']['model']} ({report['settings']['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: dict, out_dir: Path, *, with_plot: bool = True) -> list[Path]:
    """``fidelity[-<n>q].{json,md,png}`` under ``out_dir`` (``n``: the planned questions of a
    limited run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    s = report["settings"]
    stem = "fidelity" if s["limit"] is None else f"fidelity-{s.get('planned_questions', s['questions'])}q"
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(report, indent=1), encoding="utf-8")
    paths[1].write_text(markdown(report), encoding="utf-8")
    if with_plot:
        plot(report, paths[2])
    return paths


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perf.fidelity", description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="Questions of each kind (default: all).")
    ap.add_argument("--quick", action="store_true",
                    help="A smoke run: 3 questions of each kind, shares 0.25 and 1, 12 new tokens.")
    ap.add_argument("--shares", type=float, nargs="+", default=list(DEFAULT_SHARES),
                    help="Recompute shares to sweep.")
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=DEFAULT_POLICIES)
    ap.add_argument("--conditions", nargs="+", default=None,
                    help="Conditions by name instead of the share sweep: baseline, prefix, scaffold, independent, "
                         "compact, [schema+|compact+]<first|deviation|epic>@<amount> (e.g. compact+epic@4).")
    ap.add_argument("--data", default="shipped",
                    help="Question set: shipped (data/), heldout (heldout/: never tune on it) or a directory.")
    ap.add_argument("--layout", default="bundle", choices=LAYOUTS,
                    help="bundle: a schema per bundle, every prompt imports its bundle; library: one schema of "
                         "every document, a prompt imports its documents and one distractor.")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--model", default="smollm2", help="smollm2 (embedded), qwen2.5-coder-0.5b (fetched on "
                                                       "first use), a HF id or a local path.")
    ap.add_argument("--threads", type=int, default=min(2, torch.get_num_threads()))
    ap.add_argument("--machine", default=None, help="Results subfolder (default: device-arch-threads).")
    ap.add_argument("--out", type=Path, default=None, help="Output folder (default: perf/results/<machine>/fidelity).")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="Rewrite the table and plot of an earlier run's JSON (beside it) instead of running.")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text(encoding="utf-8"))
        args.from_json.with_suffix(".md").write_text(markdown(report), encoding="utf-8")
        plot(report, args.from_json.with_suffix(".png"))
        print(markdown(report))
        return 0
    if args.quick:
        args.limit = args.limit or 3
        args.shares = [0.25, 1.0]
        args.max_new_tokens = 12
    from pckernels.engine.options import check_model_path

    try:
        check_model_path(args.model)
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    args.machine = args.machine or _machine()
    out_dir = args.out or RESULTS_ROOT / args.machine / "fidelity"
    report = evaluate(args, checkpoint=lambda partial: write(partial, out_dir, with_plot=False))
    paths = write(report, out_dir)
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
