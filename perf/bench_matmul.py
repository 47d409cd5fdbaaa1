"""What ``matmul="bf16"`` costs in fidelity and buys in speed, against fp32, on the embedded model.

    python -m perf.bench_matmul [--limit N] [--tokens 20] [--threads 2] [--out DIR]

Fidelity, on the document-QA set (``perf/fidelity/data``, every question with its bundle of three
documents, ~600 prompt tokens): each question is answered greedily by an fp32 engine and a bf16
one, both plainly (``complete(reuse=False)``) and through the documents as PML modules
(``generate``). Reported: mean and max KL(fp32 || bf16) of the first-token distribution (nats),
first-token agreement, identical greedy answers, the mean length of the common prefix of the
answers, and QA accuracy (an accepted answer in the reply) for both.

Speed, interleaved on the same machine: decode tokens/s after a cached document and the TTFT of a
question over it (module path), per precision.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from perf.fidelity import dataset as qa
from perf.fidelity.scoring import contains_answer, first_token_kl
from perf.suite.runner import cpu_isa, cpu_model, machine_name
from perf.suite.stats import common_prefix
from perf.suite.texts import archive, pml_escape, sized

log = logging.getLogger(__name__)
RESULTS = Path(__file__).resolve().parent / "results"



def schemas(data: qa.Dataset) -> list[str]:
    out = []
    for index, bundle in enumerate(data.bundles):
        modules = "".join(f'<module name="{d}" xml:space="preserve">{pml_escape(data.documents[d].text)}\n</module>'
                          for d in bundle)
        out.append(f'<schema name="mm-b{index}"><system>{pml_escape(qa.SYSTEM)}\n{modules}</system></schema>')
    return out


def fidelity(engines: dict, data: qa.Dataset, limit: int | None, tokens: int) -> dict:
    questions = data.questions if limit is None else data.questions[:limit]
    rows = []
    for question in questions:
        bundle = data.bundle_of(question)
        imports = "".join(f"<{d}/>" for d in data.bundles[bundle])
        prompt = (f'<prompt schema="mm-b{bundle}">{imports}<user>{pml_escape(question.question)}</user>'
                  "<assistant/></prompt>")
        row = {"id": question.id, "kind": question.kind}
        for path in ("plain", "modules"):
            got = {}
            for name, engine in engines.items():
                if path == "plain":
                    ids = list(engine.resolve(prompt).token_ids)
                    got[name] = engine.complete(ids, max_new_tokens=tokens, reuse=False)
                else:
                    got[name] = engine.generate(prompt, max_new_tokens=tokens)
            a, b = got["fp32"], got["bf16"]
            row[path] = {"kl": first_token_kl(a.first_logits, b.first_logits), "first": a.token_ids[0] == b.token_ids[0],
                         "same": a.token_ids == b.token_ids, "prefix": common_prefix(a.token_ids, b.token_ids),
                         "correct": {n: bool(contains_answer(r.text, question.answers)) for n, r in got.items()}}
        rows.append(row)
        log.info("%s: KL %.2e / %.2e", question.id, row["plain"]["kl"], row["modules"]["kl"])
    summary = {}
    for path in ("plain", "modules"):
        kls = [r[path]["kl"] for r in rows]
        summary[path] = {"questions": len(rows), "kl_mean": statistics.mean(kls), "kl_max": max(kls),
                         "first_token_agree": sum(r[path]["first"] for r in rows),
                         "identical_answers": sum(r[path]["same"] for r in rows),
                         "mean_common_prefix": statistics.mean(r[path]["prefix"] for r in rows),
                         "accuracy": {n: sum(r[path]["correct"][n] for r in rows) for n in engines}}
    return {"rows": rows, "summary": summary, "tokens": tokens}


def speed(engines: dict, context: int, rounds: int, decode_tokens: int) -> dict:
    any_engine = next(iter(engines.values()))
    doc = pml_escape(sized(any_engine.tokenizer, archive(5), context))
    schema = f'<schema name="mm-speed"><system>Answer from the chronicle.\n<module name="doc">{doc}</module></system></schema>'
    for engine in engines.values():
        engine.add_schema(schema)
    questions = [f'<prompt schema="mm-speed"><doc/><user>Question {i}: which town sold the most wool?</user>'
                 '<assistant/></prompt>' for i in range(rounds)]
    decode = ('<prompt schema="mm-speed"><doc/><user>List every year in the chronicle with its town, one per '
              'line.</user><assistant/></prompt>')
    ttft = {n: [] for n in engines}
    rate = {n: [] for n in engines}
    for engine in engines.values():
        engine.generate(questions[0], max_new_tokens=1)
    for i in range(rounds):
        for name, engine in engines.items():
            ttft[name].append(engine.generate(questions[i], max_new_tokens=1).ttft_s)
            r = engine.generate(decode, max_new_tokens=decode_tokens)
            rate[name].append((len(r.token_ids) - 1) / max(r.total_s - r.ttft_s, 1e-9))
    return {"context_tokens": context, "rounds": rounds,
            "ttft_ms": {n: statistics.median(v) * 1e3 for n, v in ttft.items()},
            "decode_tokens_per_s": {n: statistics.median(v) for n, v in rate.items()}}


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# bf16 matmuls against fp32 — {env['machine']}", "",
             f"Embedded model, {env['threads']} threads, {env['cpu']} ({env['isa']['summary']}), torch {env['torch']}. "
             f"Command: `{env['command']}`", "", "## Fidelity (document QA)", "",
             "| path | questions | mean KL | max KL | first token agrees | identical answers | mean common prefix "
             "| accuracy fp32 | accuracy bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    for path, s in result["fidelity"]["summary"].items():
        lines.append(f"| {path} | {s['questions']} | {s['kl_mean']:.2e} | {s['kl_max']:.2e} | "
                     f"{s['first_token_agree']} | {s['identical_answers']} | {s['mean_common_prefix']:.1f} of "
                     f"{result['fidelity']['tokens']} | {s['accuracy']['fp32']} | {s['accuracy']['bf16']} |")
    sp = result["speed"]
    lines += ["", f"## Speed ({sp['context_tokens']}-token document module, {sp['rounds']} interleaved rounds)", "",
              "| matmul | question TTFT | decode tok/s |", "|---|---|---|"]
    for name in sp["ttft_ms"]:
        lines.append(f"| {name} | {sp['ttft_ms'][name]:.0f} ms | {sp['decode_tokens_per_s'][name]:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_matmul", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, help="first N questions only")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    from pckernels.engine import PromptCache

    engines = {m: PromptCache.from_pretrained(store_dir=False, matmul=m) for m in ("fp32", "bf16")}
    data = qa.load()
    for text in schemas(data):
        for engine in engines.values():
            engine.add_schema(text)
    t0 = time.perf_counter()
    result = {"environment": {"machine": machine_name(), "cpu": cpu_model(), "isa": cpu_isa(), "threads": args.threads,
                              "torch": torch.__version__, "command": "python -m perf.bench_matmul " + " ".join(sys.argv[1:] if argv is None else argv)},
              "fidelity": fidelity(engines, data, args.limit, args.tokens)}
    result["speed"] = speed(engines, args.context, args.rounds, args.decode_tokens)
    result["seconds"] = time.perf_counter() - t0
    out = args.out or RESULTS / machine_name() / "matmul"
    out.mkdir(parents=True, exist_ok=True)
    (out / "matmul.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
