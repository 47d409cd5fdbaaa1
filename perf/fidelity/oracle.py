"""Cached vs the reference oracle on the embedded model, at schema and compact placement.

``python -m perf.fidelity.oracle --layout library --limit 16`` answers each question's prompt in
``cached`` and ``reference`` mode (the full forward at the prompt's positions with the module-
scoped mask) and reports the max-abs difference of the fp32 first-token logits and whether the
greedy tokens agree, split by placement and by whether any cached token's encoding context moved
(``plan._moved_tokens``: re-rotation is exact only where nothing did). A second part moves
documents of a schema without anonymous text (no context at all), where re-rotation alone is
measured: ``bare`` rows.
"""

from __future__ import annotations

import statistics
import sys


from perf.fidelity import dataset as ds
from perf.fidelity.runner import open_probe, probe_parser, write_probe


def compare(cache, prompt: str, new_tokens: int) -> dict:
    from pckernels.engine.plan import _moved_tokens, scaffold_variants

    resolved = cache.resolve(prompt)
    got = cache.generate(prompt, max_new_tokens=new_tokens)
    ref = cache.generate(prompt, mode="reference", max_new_tokens=new_tokens)
    moved = _moved_tokens(resolved, scaffold_variants(resolved))
    agree = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)) if a != b), len(got.token_ids))
    return {"max_abs": float((got.first_logits - ref.first_logits).abs().max()), "moved": len(moved),
            "first_agree": got.token_ids[0] == ref.token_ids[0], "agree": got.token_ids == ref.token_ids,
            "agreeing_prefix": agree, "logit_scale": float(ref.first_logits.abs().max())}


def bare_schema(data: ds.Dataset) -> str:
    from xml.sax.saxutils import escape

    parts = "".join(f'<module name="{d}">{escape(data.documents[d].text)}</module>' for d in data.library)
    return f'<schema name="bare-{data.name}">{parts}</schema>'


def summarize(rows: list[dict]) -> dict:
    if not rows:
        return {}
    diffs = sorted(r["max_abs"] for r in rows)
    return {"n": len(rows), "max_abs_median": statistics.median(diffs), "max_abs_max": diffs[-1],
            "first_agree": 100 * statistics.fmean(r["first_agree"] for r in rows),
            "agree": 100 * statistics.fmean(r["agree"] for r in rows),
            "logit_scale": statistics.median(r["logit_scale"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser("python -m perf.fidelity.oracle", __doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args(argv)

    data, cache, questions = open_probe(args)
    bare = cache.add_schema(bare_schema(data))
    rows: list[dict] = []
    for number, question in enumerate(questions, 1):
        if args.layout == "library":
            cache.add_schema(ds.library_schema(data))
        else:
            cache.add_schema(ds.bundle_schema(data, data.bundle_of(question)))
        for placement in ("schema", "compact"):
            prompt = ds.prompt(data, question, layout=args.layout, placement=placement)
            rows.append({"question": question.id, "placement": placement, **compare(cache, prompt, args.new_tokens)})
        docs = ds.imported(data, question, "library")
        imports = "".join(f"<{d}/>" for d in docs)
        prompt = (f'<prompt schema="{bare.name}" placement="compact">{imports}<user>{question.question}</user>'
                  '<assistant/></prompt>')
        rows.append({"question": question.id, "placement": "bare", **compare(cache, prompt, args.new_tokens)})
        print(f"[{number}] " + "  ".join(f"{r['placement']}: {r['max_abs']:.2e} moved={r['moved']} agree={r['agree']}"
                                          for r in rows[-3:]), flush=True)
    summary = {}
    for placement in ("schema", "compact", "bare"):
        chosen = [r for r in rows if r["placement"] == placement]
        summary[placement] = {"all": summarize(chosen),
                              "nothing moved": summarize([r for r in chosen if not r["moved"]]),
                              "context moved": summarize([r for r in chosen if r["moved"]])}
    return write_probe(args, summary, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
