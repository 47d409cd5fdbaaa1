"""Where the last prompt token looks: attention mass by part of the prompt, per placement.

``python -m perf.fidelity.attention --layout library --limit 20`` answers, for each question, the
first-token forward in three ways — ``baseline`` (contiguous, causal), ``schema`` and ``compact``
placement (cached) — and records the softmax weights of the prompt's last token (the one that
predicts the answer) over every key, averaged over heads, per layer. Keys are grouped by token:
the system prompt, the first ``--start`` tokens of each imported document ("module starts": an
independently encoded module's opening, the EPIC attention-sink suspect), the rest of each
document (answer document and distractor apart), the anonymous text after the documents and the
question. Tokens are matched across modes by their index in the prompt, so the groups are the
same tokens whatever their positions.

It wraps ``torch.nn.functional.scaled_dot_product_attention`` for the duration of each call to
capture queries and keys (analysis only: one thread, nothing else running).
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from perf.fidelity import dataset as ds
from perf.fidelity.runner import open_probe, probe_parser

GROUPS = ("system", "answer_start", "answer_rest", "other_start", "other_rest", "tail", "question")


class _Capture:
    """Replaces SDPA while active; keeps the last query row's weights ``[H, kv]`` per call."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self._orig = torch.nn.functional.scaled_dot_product_attention

    def __enter__(self):
        orig = self._orig

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 **kw):
            q = query[0, :, -1:].float()
            k = key[0].float()
            if k.shape[0] != q.shape[0]:
                k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
            s = scale if scale is not None else q.shape[-1] ** -0.5
            scores = (q @ k.transpose(-1, -2))[:, 0] * s
            if attn_mask is not None:
                m = attn_mask[0, :, -1].float() if attn_mask.dtype != torch.bool else \
                    torch.where(attn_mask[0, :, -1], 0.0, float("-inf"))
                scores = scores + m
            self.calls.append(torch.softmax(scores, dim=-1))
            return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa, **kw)

        torch.nn.functional.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._orig


def token_groups(data: ds.Dataset, question: ds.Question, resolved, start: int) -> list[str]:
    """The group of each prompt token (in ``resolved.token_ids`` order)."""
    answer = question.docs[-1]
    groups: list[str] = []
    seen_module = False
    for seg in resolved.live_segments():
        n = len(seg.token_ids)
        if seg.kind == "text":
            groups += ["question"] * n
        elif seg.module == "":
            groups += ["tail" if seen_module else "system"] * n
        else:
            seen_module = True
            kind = "answer" if seg.module == answer else "other"
            groups += [f"{kind}_start" if i < start else f"{kind}_rest" for i in range(n)]
    return groups


def attention_by_group(cache, prompt: str, resolved, groups: list[str], mode: str) -> list[dict[str, float]]:
    """Per layer, ``{group: mass}`` of the last prompt token's attention (mean over heads)."""
    layers = cache.layout.num_layers
    by_pos = {p: i for i, p in enumerate(resolved.position_ids if mode != "baseline"
                                         else range(len(resolved.token_ids)))}
    with _Capture() as capture:
        cache.evict_resident()
        cache.generate(prompt, mode="baseline" if mode == "baseline" else "cached", max_new_tokens=1)
    calls = capture.calls
    per = len(calls) // layers
    if per * layers != len(calls):
        raise RuntimeError(f"{len(calls)} attention calls for {layers} layers")
    arena = cache.scheduler.arena
    out = []
    for layer in range(layers):
        weights = calls[layer * per + per - 1].mean(dim=0)
        keys = weights.shape[0]
        positions = arena.row_pos[:keys].tolist()
        mass = dict.fromkeys(GROUPS, 0.0)
        for row, w in enumerate(weights.tolist()):
            if w <= 0:
                continue
            index = by_pos.get(positions[row])
            if index is not None:
                mass[groups[index]] += w
        out.append(mass)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser("python -m perf.fidelity.attention", __doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=4, help="Tokens of a document counted as its start.")
    args = ap.parse_args(argv)

    data, cache, questions = open_probe(args)
    records = []
    for number, question in enumerate(questions, 1):
        if args.layout == "library":
            schema = cache.add_schema(ds.library_schema(data))
        else:
            schema = cache.add_schema(ds.bundle_schema(data, data.bundle_of(question)))
        cache.encoder.encode_schema(schema, geometries=("packed",))
        row = {"question": question.id, "kind": question.kind}
        for mode in ("baseline", "schema", "compact"):
            prompt = ds.prompt(data, question, layout=args.layout, placement="compact" if mode == "compact" else "schema")
            resolved = cache.resolve(prompt)
            groups = token_groups(data, question, resolved, args.start)
            row[mode] = attention_by_group(cache, prompt, resolved, groups, mode)
        records.append(row)
        mean = {m: {g: statistics.fmean(layer[g] for layer in row[m]) for g in GROUPS}
                for m in ("baseline", "schema", "compact")}
        print(f"[{number}] {question.id} " + " | ".join(
            f"{m}: " + " ".join(f"{g}={v:.3f}" for g, v in mean[m].items()) for m in mean), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "records": records}),
                            encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
