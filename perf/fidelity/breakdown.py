"""Why answers are lost: a fidelity run's records split by where the answering document sits.

``python -m perf.fidelity.breakdown RUN.json [RUN2.json ...]`` prints, per condition and question
kind, accuracy, lost / gained against baseline, first-token agreement and mean KL, split by whether
the answering document is the first imported one (right after the system prompt) or comes after
the distractor (library layout), and by the schema gap between the system prompt and it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def groups(record: dict) -> list[str]:
    extra = record.get("extra") or {}
    out = ["all"]
    if "answer_index" in extra:
        out.append("answer first" if extra["answer_index"] == 0 else "answer after another doc")
    if "schema_gap" in extra:
        out.append("schema gap 0" if extra["schema_gap"] == 0 else
                   "schema gap < 1000" if extra["schema_gap"] < 1000 else "schema gap >= 1000")
    return out


def table(records: list[dict]) -> list[str]:
    base = {r["question"]: r for r in records if r["condition"] == "baseline"}
    conditions = list(dict.fromkeys(r["condition"] for r in records))
    cells: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        for g in groups(r):
            cells.setdefault((r["kind"], g, r["condition"]), []).append(r)
    lines = []
    for kind in ("single", "cross"):
        names = sorted({g for (k, g, _) in cells if k == kind}, key=lambda g: (g != "all", g))
        for g in names:
            rows = [(c, cells.get((kind, g, c), [])) for c in conditions]
            n = len(rows[0][1])
            if not n:
                continue
            lines += [f"### {kind}, {g} ({n} questions)", "",
                      "| condition | contains | lost / gained | first | KL |", "|---|---:|---:|---:|---:|"]
            for cond, chosen in rows:
                if not chosen:
                    continue
                lost = sum(base[r["question"]]["contains"] > r["contains"] for r in chosen)
                gained = sum(base[r["question"]]["contains"] < r["contains"] for r in chosen)
                lines.append(f"| {cond} | {100 * statistics.fmean(r['contains'] for r in chosen):.1f} | "
                             f"{lost} / {gained} | {100 * statistics.fmean(r['first_agree'] for r in chosen):.0f} | "
                             f"{statistics.fmean(r['kl'] for r in chosen):.3f} |")
            lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    for path in (argv if argv is not None else sys.argv[1:]):
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        s = report["settings"]
        print(f"## {path}: {s.get('data', 'shipped')} set, {s.get('layout', 'bundle')} layout, "
              f"{s['questions']} questions\n")
        print("\n".join(table(report["records"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
