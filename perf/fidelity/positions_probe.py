"""Which distance hurts: full causal attention over a prompt's tokens at chosen positions.

``python -m perf.fidelity.positions_probe --layout library`` reads each question's prompt (its
documents, a distractor and the question, schema order) with plain causal attention — no cached
modules at all — at four position layouts, and answers greedily as the fidelity runner does:

* ``contiguous``: positions 0..n-1 (= the runner's baseline);
* ``schema``: the schema positions (= ``schema+first@1``: every stale token recomputed);
* ``gaps_only``: the documents at their schema positions (gaps before and between them), the
  text after them right after the last one;
* ``tail_only``: everything contiguous but the text after the documents, which starts where
  the schema ends (the distance from the documents to the question, without gaps before them).

So positions alone, with attention left whole, are separated into the gaps in front of the
documents and the distance between the documents and the question.
"""

from __future__ import annotations

import statistics
import sys

import torch
from transformers import DynamicCache

from perf.fidelity import dataset as ds
from perf.fidelity.runner import open_probe, probe_parser, write_probe
from perf.fidelity.scoring import contains_answer, first_token_kl

LAYOUTS = ("contiguous", "schema", "gaps_only", "tail_only")


def layouts(resolved) -> dict[str, list[int]]:
    """Position ids of the prompt's live tokens under each layout."""
    schema_pos = list(resolved.position_ids)
    n = len(schema_pos)
    end_docs = max(i for i, seg in enumerate(_token_segments(resolved)) if seg.kind == "cached" and seg.module)
    gaps = schema_pos[:end_docs + 1] + list(range(schema_pos[end_docs] + 1, schema_pos[end_docs] + n - end_docs))
    first_after = end_docs + 1
    tail = list(range(first_after)) + list(range(schema_pos[first_after], schema_pos[first_after] + n - first_after))
    return {"contiguous": list(range(n)), "schema": schema_pos, "gaps_only": gaps, "tail_only": tail}


def _token_segments(resolved) -> list:
    out = []
    for seg in resolved.live_segments():
        out += [seg] * len(seg.token_ids)
    return out


@torch.inference_mode()
def answer(cache, ids: list[int], positions: list[int], max_new: int, stops: list[str]) -> tuple[str, torch.Tensor]:
    """Greedy answer (ended by an end-of-sequence id or cut at the first of ``stops``) and fp32
    first logits of causal attention over ``ids`` at ``positions``."""
    from pckernels.generation import TextStream

    past = DynamicCache(config=cache.model.config)
    logits = cache.adapter.forward(torch.tensor([ids]), torch.tensor([positions]), None, past)[-1]
    first = logits.float()
    text = TextStream(cache.tokenizer, stops)
    pos = positions[-1]
    for _ in range(max_new):
        token = int(torch.argmax(logits))
        text.push([token])
        if token in cache.eos_ids or text.stopped:
            break
        pos += 1
        logits = cache.adapter.forward(torch.tensor([[token]]), torch.tensor([[pos]]), None, past)[-1]
    text.finish()
    return text.text, first


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser("python -m perf.fidelity.positions_probe", __doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    data, cache, questions = open_probe(args)
    stops = ["\n", ". "]
    records = []
    for number, question in enumerate(questions, 1):
        if args.layout == "library":
            cache.add_schema(ds.library_schema(data))
        else:
            cache.add_schema(ds.bundle_schema(data, data.bundle_of(question)))
        resolved = cache.resolve(ds.prompt(data, question, layout=args.layout))
        ids = list(resolved.token_ids)
        row = {"question": question.id, "kind": question.kind}
        base_logits = None
        for name, positions in layouts(resolved).items():
            text, first = answer(cache, ids, positions, args.max_new_tokens, stops)
            base_logits = first if base_logits is None else base_logits
            row[name] = {"text": text, "contains": contains_answer(text, question.answers),
                         "kl": first_token_kl(base_logits, first), "last_position": positions[-1]}
        records.append(row)
        print(f"[{number}] {question.id} " + " ".join(f"{k}={row[k]['contains']:.0f}" for k in LAYOUTS), flush=True)
    summary = {}
    for kind in ("single", "cross", "all"):
        chosen = [r for r in records if kind == "all" or r["kind"] == kind]
        if not chosen:
            continue
        summary[kind] = {name: {"contains": 100 * statistics.fmean(r[name]["contains"] for r in chosen),
                                "lost": sum(r["contiguous"]["contains"] > r[name]["contains"] for r in chosen),
                                "gained": sum(r["contiguous"]["contains"] < r[name]["contains"] for r in chosen),
                                "kl": statistics.fmean(r[name]["kl"] for r in chosen), "n": len(chosen)}
                         for name in LAYOUTS}
    return write_probe(args, summary, records=records)


if __name__ == "__main__":
    sys.exit(main())
