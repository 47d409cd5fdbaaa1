"""Which stale tokens matter: recompute chosen groups of them at compact placement.

``python -m perf.fidelity.recompute_probe --layout library`` answers each question at compact
placement with exactly these stale tokens recomputed (``plan.stale_tokens``), so EPIC's recompute
of every module's first k tokens is split into its parts:

* ``none``: plain compact placement;
* ``tail``: the anonymous text after the documents (the role suffix ``<|im_end|>\\n`` in these
  prompts, encoded against the system prompt only and read right before the question);
* ``starts@k``: the first ``k`` stale tokens of every document, nothing else;
* ``tail+starts@k``: both (= ``recompute_policy="epic"``, ``recompute=k``);
* ``rest@k``: the stale document tokens after the first ``k`` (everything but the starts) — as
  many tokens again elsewhere, to tell "starts" from "any recompute".
"""

from __future__ import annotations

import statistics
import sys


from perf.fidelity import dataset as ds
from perf.fidelity.runner import open_probe, probe_parser, write_probe
from perf.fidelity.scoring import contains_answer, first_token_kl


def selections(stale: list[tuple[str, int]], ks: list[int]) -> dict[str, frozenset]:
    by_module: dict[str, list[tuple[str, int]]] = {}
    for ref in stale:
        by_module.setdefault(ref[0], []).append(ref)
    tail = [ref for ref in stale if ref[0] == ""]
    docs = {m: refs for m, refs in by_module.items() if m}
    out = {"none": frozenset(), "tail": frozenset(tail)}
    for k in ks:
        starts = [r for refs in docs.values() for r in refs[:k]]
        rest = [r for refs in docs.values() for r in refs[k:2 * k]]
        out[f"starts@{k}"] = frozenset(starts)
        out[f"tail+starts@{k}"] = frozenset(starts + tail)
        out[f"rest@{k}"] = frozenset(rest)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser("python -m perf.fidelity.recompute_probe", __doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    from pckernels.engine.plan import plan_request, stale_tokens
    from pckernels.engine.request import Request
    from pckernels.generation import SamplingParams

    data, cache, questions = open_probe(args)
    params = SamplingParams(args.max_new_tokens, stop=("\n", ". "))
    records = []
    for number, question in enumerate(questions, 1):
        schema = cache.add_schema(ds.library_schema(data) if args.layout == "library"
                                  else ds.bundle_schema(data, data.bundle_of(question)))
        cache.encoder.encode_schema(schema, geometries=("packed",))
        plain = cache.resolve(ds.prompt(data, question, layout=args.layout))
        base = cache.generate(plain, mode="baseline", max_new_tokens=args.max_new_tokens, stop=["\n", ". "])
        resolved = cache.resolve(ds.prompt(data, question, layout=args.layout, placement="compact"))
        row = {"question": question.id, "kind": question.kind,
               "baseline": {"contains": contains_answer(base.text, question.answers), "kl": 0.0, "computed": 0}}
        for name, chosen in selections(stale_tokens(resolved), args.k).items():
            plan = plan_request(resolved, chosen)
            request = Request(params, "cached", list(resolved.token_ids), list(resolved.position_ids), plan=plan,
                              schema=resolved.schema)
            got = cache.submit(request).result()
            row[name] = {"contains": contains_answer(got.text, question.answers), "recomputed": len(chosen),
                         "kl": first_token_kl(base.first_logits, got.first_logits), "text": got.text}
        records.append(row)
        print(f"[{number}] {question.id} " + " ".join(f"{k}={v['contains']:.0f}" for k, v in row.items()
                                                    if isinstance(v, dict)), flush=True)
    names = [k for k, v in records[0].items() if isinstance(v, dict)]
    summary = {}
    for kind in ("single", "cross", "all"):
        chosen = [r for r in records if kind == "all" or r["kind"] == kind]
        summary[kind] = {n: {"contains": 100 * statistics.fmean(r[n]["contains"] for r in chosen),
                             "lost": sum(r["baseline"]["contains"] > r[n]["contains"] for r in chosen),
                             "gained": sum(r["baseline"]["contains"] < r[n]["contains"] for r in chosen),
                             "kl": statistics.fmean(r[n]["kl"] for r in chosen),
                             "recomputed": statistics.fmean(r[n].get("recomputed", 0) for r in chosen)}
                         for n in names}
    return write_probe(args, summary, records=records)


if __name__ == "__main__":
    sys.exit(main())
