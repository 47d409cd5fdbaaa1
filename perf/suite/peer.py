"""Experiment 8 — llama.cpp, the CPU peer a user would pick instead, on the same weights and token ids.

Skipped (with the reason in the results) when no interpreter with llama-cpp-python is found
(:mod:`perf.peers.llamacpp`) or the engine does not run the embedded model. The peer runs the
embedded model as F32 weights (``perf.peers.gguf_f32``; promptcache runs the same weights
dequantized to fp32) with flash attention off and on, and as the shipped Q4_1 file; promptcache
runs as configured (``--matmul`` picks its matmul precision). Both engines get the very same
token ids: a chronicle document of each context size in a chat prompt, then different short
questions.

Per context size, in interleaved rounds (each round: every configuration once):

* **cold prefill**: the whole prompt with nothing cached (promptcache: ``complete(reuse=False)``);
* **a few new tokens after the cached document**: a new question over the document read before
  (llama.cpp keeps the longest cached prefix, as its server does; promptcache: the document as a
  PML module, and plain ``complete()`` with exact prefix reuse);
* **decode**: greedy tokens/s after it, ``decode_tokens`` tokens (promptcache: the module prompt).

The first token of every hit is compared between the engines (same weights, same ids).
"""

from __future__ import annotations

import logging
import time

from perf.peers import gguf_f32
from perf.peers.llamacpp import Peer, find_python
from perf.suite.context import Bench
from perf.suite.stats import common_prefix, summarize
from perf.suite.texts import archive, pml_escape, sized

log = logging.getLogger(__name__)

QUESTIONS = ("Which town counted the most carts of wool?", "In which year was the river bridge repaired in winter?",
             "Name a town that ground barley.", "How many carts of salt went to Corran?",
             "Which goods did Fenwick send most often?", "What happened in the spring of the first year?",
             "List the towns that shipped amber.", "Which year had the most tons of iron?")
DECODE_INSTRUCTION = "List every year mentioned in the chronicle with the town and the goods, one per line."


def steps(bench: Bench) -> int:
    cfg = bench.config
    return len(cfg.peer_contexts) * (2 + cfg.repeats * 3)


def _prompts(bench: Bench, context: int) -> tuple[str, list[str]]:
    """The schema (the document as a module) and the PML prompts of the questions."""
    doc = pml_escape(sized(bench.tokenizer, archive(31), context))
    schema = (f'<schema name="peer-{context}"><system>Answer from the chronicle.\n<module name="doc">{doc}'
              f'</module></system></schema>')
    prompts = [f'<prompt schema="peer-{context}"><doc/><user>{q}</user><assistant/></prompt>'
               for q in (*QUESTIONS, DECODE_INSTRUCTION)]
    return schema, prompts


def run(bench: Bench) -> dict:
    cfg = bench.config
    python, version = find_python(cfg.peer_python)
    if python is None:
        log.warning("llama.cpp peer skipped: %s", version)
        return {"skipped": version}
    if bench.engine.name != "SmolLM2-135M-Instruct":
        return {"skipped": f"the peer runs the embedded model; this engine runs {bench.engine.name}"}
    from pckernels.integration.embedded import gguf_path

    models = {"f32": gguf_f32.embedded_f32(), "q4_1": gguf_path()}
    setups = [("f32", False), ("f32", True), ("q4_1", False)]
    engine = bench.engine
    peer = Peer(python)
    out = {"llama_cpp_python": version, "threads": cfg.peer_threads, "promptcache_matmul": engine.matmul,
           "contexts": []}
    try:
        for context in cfg.peer_contexts:
            out["contexts"].append(_context(bench, peer, models, setups, context))
    finally:
        peer.close()
    return out


def _context(bench: Bench, peer: Peer, models: dict, setups: list, context: int) -> dict:
    cfg, engine = bench.config, bench.engine
    schema, prompts = _prompts(bench, context)
    bench.add_schema(schema)
    ids = [list(engine.resolve(p).token_ids) for p in prompts]
    n_ctx = max(len(i) for i in ids) + cfg.decode_tokens + 16
    samples: dict[str, list[float]] = {}
    agree: list[bool] = []
    decode_rates: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    # cold prefill: once per engine and setup (seconds at 8K: tens)
    for model, flash in setups:
        peer.load(models[model], n_ctx=n_ctx, threads=cfg.peer_threads, flash_attn=flash)
        add(f"cold/llama.cpp {model}{' fa' if flash else ''}", peer.prefill(ids[0])["seconds"])
        bench.ticker.advance()
    engine.prefix.clear()
    add("cold/promptcache", engine.complete(ids[0], max_new_tokens=1, reuse=False).ttft_s)
    bench.ticker.advance()
    engine.complete(ids[0], max_new_tokens=1)
    for round_index in range(cfg.repeats):
        question = 1 + round_index % (len(QUESTIONS) - 1)
        for model, flash in setups:
            label = f"llama.cpp {model}{' fa' if flash else ''}"
            peer.load(models[model], n_ctx=n_ctx, threads=cfg.peer_threads, flash_attn=flash)
            peer.prefill(ids[0])
            hit = peer.hit(ids[question])
            add(f"hit/{label}", hit["seconds"])
            peer.hit(ids[-1])
            decoded = peer.decode(cfg.decode_tokens)
            decode_rates.setdefault(label, []).append((cfg.decode_tokens - 1) / decoded["seconds"])
            if model == "f32" and not flash:
                reference = hit["token"]
        bench.ticker.advance()
        module = engine.generate(prompts[question], max_new_tokens=1)
        add("hit/promptcache module", module.ttft_s)
        plain = engine.complete(ids[question], max_new_tokens=1)
        add("hit/promptcache prefix", plain.ttft_s)
        agree.append(module.token_ids[0] == reference == plain.token_ids[0])
        bench.ticker.advance()
        t0 = time.perf_counter()
        decoded = engine.generate(prompts[-1], max_new_tokens=cfg.decode_tokens)
        decode_rates.setdefault("promptcache module", []).append(
            (len(decoded.token_ids) - 1) / max(decoded.total_s - decoded.ttft_s, 1e-9))
        plain = engine.complete(ids[-1], max_new_tokens=cfg.decode_tokens)
        decode_rates.setdefault("promptcache prefix", []).append(
            (len(plain.token_ids) - 1) / max(plain.total_s - plain.ttft_s, 1e-9))
        log.debug("promptcache decode round %d: %.1f s", round_index, time.perf_counter() - t0)
        bench.ticker.advance()
    recomputed = len(ids[1]) - engine.complete(ids[1], max_new_tokens=1).cached_tokens
    return {"context_tokens": len(ids[0]), "question_tokens": len(ids[1]) - common_prefix(ids[0], ids[1]),
            "prefix_recomputed_tokens": recomputed,
            "seconds": {name: summarize(values) for name, values in samples.items()},
            "decode_tokens_per_s": {name: summarize(values) for name, values in decode_rates.items()},
            "first_token_agrees": sum(agree), "rounds": len(agree)}


