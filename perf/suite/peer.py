"""Experiment 8 — llama.cpp, the CPU peer a user would pick instead, on the same weights and token ids.

Skipped (with the reason in the results) when no interpreter with llama-cpp-python is found
(:mod:`perf.peers.llamacpp`) or the engine runs neither the embedded model nor a fetched one. The
peer runs the model's GGUF as F32 weights (``perf.peers.gguf_f32``; promptcache runs the same
weights dequantized to fp32) with flash attention off and on, and as the quantized file itself
(the embedded model's Q4_1, the fetched Qwen2.5-Coder's Q4_K_M); promptcache
runs as configured (``--matmul`` picks its matmul precision). Both engines get the very same
token ids: a chronicle document of each context size in a chat prompt, then different short
questions.

Per context size, in interleaved rounds (each round: every configuration once):

* **cold prefill**: the whole prompt with nothing cached (promptcache: ``complete(reuse=False)``),
  ``repeats`` times;
* **a few new tokens after the cached document**: a new question over the document read before
  (llama.cpp keeps the longest cached prefix, as its server does; promptcache: the document as a
  PML module, and plain ``complete()`` with exact prefix reuse);
* **decode**: greedy tokens/s after it, ``decode_tokens`` tokens (promptcache: the module prompt
  and ``complete()``); with ``peer_lookahead`` (``--lookahead K``) also with prompt-lookup drafts
  of up to K tokens on both engines (the same drafter, :mod:`pckernels.engine.lookahead`), for
  the listing instruction, which copies from the document, and for a free-form one
  (``… lookahead K``, ``free: …`` rows).

The first token of every hit is compared between the engines (same weights, same ids).
"""

from __future__ import annotations

import logging

from perf.peers import gguf_f32
from perf.peers.llamacpp import Peer, find_python
from perf.suite.context import Bench
from perf.suite.stats import common_prefix, summarize
from perf.suite.texts import archive, pml_escape, sized

log = logging.getLogger(__name__)

LOOKAHEAD_SETUPS = ("llama.cpp f32", "llama.cpp f32 kv f32")
"""llama.cpp set-ups also measured with prompt-lookup drafts."""

QUESTIONS = ("How many tons of copper did the mills grind?", "Which town counted the most carts of wool?", "In which year was the river bridge repaired in winter?",
             "Name a town that ground barley.", "How many carts of salt went to Corran?",
             "Which goods did Fenwick send most often?", "What happened in the spring of the first year?",
             "List the towns that shipped amber.", "Which year had the most tons of iron?")
DECODE_INSTRUCTION = "List every year mentioned in the chronicle with the town and the goods, one per line."
FREE_INSTRUCTION = "Write a short poem about the sea."


class DocumentCopies:
    """The document read into ``engine``'s prefix cache once per salt, untimed, so that a plain
    hit can be asked a question no earlier round stored: an engine with token resumption stores
    what a hit computes, so a question asked again under the same salt (by another CPU path, or
    a later cycle of the questions) would be an exact repeat, no forward at all. ``ids``: the
    document's prompt (any question after it)."""

    def __init__(self, engine, ids: list[int]) -> None:
        self.engine, self.ids, self.loaded = engine, ids, {""}

    def salt(self, name: str) -> str:
        """``name``, the document read under it first if it was not (``""``: read by the caller)."""
        if name not in self.loaded:
            self.engine.complete(self.ids, max_new_tokens=1, salt=name)
            self.loaded.add(name)
        return name

    def cycle(self, index: int, period: int, tag: str = "") -> str:
        """The salt of round ``index`` when the questions repeat every ``period`` rounds: one per
        cycle (and ``tag``, e.g. a CPU path); the first cycle untagged is ``""``."""
        return self.salt(f"{tag} {index // period}".strip() if tag or index >= period else "")

    def cleared(self) -> None:
        """The prefix cache was cleared: every salt's copy is gone (``""`` too)."""
        self.loaded = set()

    def check(self, hit, question_ids: list[int]) -> None:
        """Refuse a plain hit that restored the question too (an exact repeat) or not the document
        (evicted: a cold read) — either would be timed as what it is not."""
        if not len(self.ids) // 2 < hit.cached_tokens < len(question_ids):
            raise RuntimeError(f"a plain hit restored {hit.cached_tokens} of {len(question_ids)} tokens: not a new "
                               f"question over the {len(self.ids)}-token document")


def steps(bench: Bench) -> int:
    cfg = bench.config
    return len(cfg.peer_contexts) * cfg.repeats * 5


def _prompts(bench: Bench, context: int) -> tuple[str, list[str]]:
    """The schema (the document as a module) and the PML prompts of the questions."""
    doc = pml_escape(sized(bench.tokenizer, archive(31), context))
    schema = (f'<schema name="peer-{context}"><system>Answer from the chronicle.\n<module name="doc">{doc}'
              f'</module></system></schema>')
    prompts = [f'<prompt schema="peer-{context}"><doc/><user>{q}</user><assistant/></prompt>'
               for q in (*QUESTIONS, FREE_INSTRUCTION, DECODE_INSTRUCTION)]
    return schema, prompts


def run(bench: Bench) -> dict:
    cfg = bench.config
    python, version = find_python(cfg.peer_python)
    if python is None:
        log.warning("llama.cpp peer skipped: %s", version)
        return {"skipped": version}
    models = gguf_f32.peer_weights(bench.engine.name)
    if models is None:
        return {"skipped": f"the peer runs the embedded or a fetched model's GGUF; this engine runs {bench.engine.name}"}
    # (weights, flash attention, KV cache type): llama.cpp's default KV is F16, half the bytes
    # promptcache's fp32 KV reads per decoded token; "kv f32" is the same arithmetic on both sides
    setups = {"llama.cpp f32": ("f32", False, "f16"), "llama.cpp f32 kv f32": ("f32", False, "f32")}
    setups.update({f"llama.cpp {quant}": (quant, False, "f16") for quant in models if quant != "f32"})
    if cfg.peer_flash:
        setups["llama.cpp f32 fa"] = ("f32", True, "f16")
    out = {"llama_cpp_python": version, "weights": {label: str(path) for label, path in models.items()},
           "threads": cfg.peer_threads, "promptcache_matmul": bench.engine.matmul,
           "contexts": [], "failed": {}, "no_repack": []}
    for context in cfg.peer_contexts:
        out["contexts"].append(_context(bench, python, models, setups, context, out["failed"], out["no_repack"]))
    return out


PROBE = list(range(1, 17))
"""Token ids a new worker reads once before it is measured (any model's vocabulary has them)."""


class _Setups:
    """One llama.cpp worker per set-up, each keeping its own cache between rounds (as a server
    would). A worker reads a few tokens first; if llama.cpp's repacked weight kernels die there of
    an illegal instruction (its AMX kernels on this VM, whose CPU advertises AMX), the set-up runs
    with repacking off (``--no-repack``) and says so in ``no_repack``. A set-up whose worker still
    dies is recorded in ``failed`` and left out."""

    def __init__(self, python: str, models: dict, setups: dict, n_ctx: int, threads: int, failed: dict,
                 no_repack: list) -> None:
        self.peers: dict[str, Peer] = {}
        self.failed = failed
        for label, (model, flash, kv) in setups.items():
            if label in failed:
                continue
            load = dict(n_ctx=n_ctx, threads=threads, flash_attn=flash, kv=kv)
            peer = self._start(python, label, models[model], load, repack=label not in no_repack)
            if peer is None and label not in failed:
                log.warning("%s: llama.cpp's repacked kernels died of SIGILL; again with --no-repack", label)
                no_repack.append(label)
                peer = self._start(python, label, models[model], load, repack=False)
            if peer is not None:
                self.peers[label] = peer

    def _start(self, python: str, label: str, model, load: dict, repack: bool) -> Peer | None:
        """A worker that has loaded ``model`` and read the probe; None when it died — of SIGILL
        with repacking on (worth a retry without), or of anything else (then recorded in
        ``failed``)."""
        peer = Peer(python)
        try:
            peer.load(model, repack=repack, **load)
            peer.prefill(PROBE)
        except RuntimeError as exc:
            if repack and peer.died_of_sigill():
                peer.close()
            else:
                self._fail(label, peer, exc)
            return None
        return peer

    def _fail(self, label: str, peer: Peer, exc: Exception) -> None:
        log.warning("%s left out: %s", label, exc)
        self.failed[label] = str(exc)
        peer.close()
        self.peers.pop(label, None)

    def each(self, fn, only: tuple[str, ...] | None = None) -> dict:
        """``{label: fn(peer)}`` for the set-ups still running (of ``only``, if given)."""
        out = {}
        for label, peer in list(self.peers.items()):
            if only is not None and label not in only:
                continue
            try:
                out[label] = fn(peer)
            except RuntimeError as exc:
                self._fail(label, peer, exc)
        return out

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()


def _context(bench: Bench, python: str, models: dict, setups: dict, context: int, failed: dict,
             no_repack: list) -> dict:
    cfg, engine = bench.config, bench.engine
    schema, prompts = _prompts(bench, context)
    bench.add_schema(schema)
    ids = [list(engine.resolve(p).token_ids) for p in prompts]
    n_ctx = max(len(i) for i in ids) + cfg.decode_tokens + 16
    samples: dict[str, list[float]] = {}
    decode_rates: dict[str, list[float]] = {}
    agree: list[bool] = []

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    peers = _Setups(python, models, setups, n_ctx, cfg.peer_threads, failed, no_repack)
    try:
        for _ in range(cfg.repeats):  # interleaved; llama.cpp's cache ends holding ids[0] for the hits
            for label, answer in peers.each(lambda p: p.prefill(ids[0])).items():
                add(f"cold/{label}", answer["seconds"])
            bench.ticker.advance()
            engine.prefix.clear()
            add("cold/promptcache", engine.complete(ids[0], max_new_tokens=1, reuse=False).ttft_s)
            bench.ticker.advance()
        engine.complete(ids[0], max_new_tokens=1)
        engine.generate(prompts[0], max_new_tokens=1)
        copies = DocumentCopies(engine, ids[0])
        for round_index in range(cfg.repeats):
            question = 2 + round_index % (len(QUESTIONS) - 2)
            salt = copies.cycle(round_index, len(QUESTIONS) - 2)
            hits = peers.each(lambda p: p.hit(ids[question]))
            for label, answer in hits.items():
                add(f"hit/{label}", answer["seconds"])
            bench.ticker.advance()
            module = engine.generate(prompts[question], max_new_tokens=1)
            add("hit/promptcache module", module.ttft_s)
            plain = engine.complete(ids[question], max_new_tokens=1, salt=salt)
            copies.check(plain, ids[question])
            add("hit/promptcache prefix", plain.ttft_s)
            reference = hits.get("llama.cpp f32", {}).get("token")
            agree.append(module.token_ids[0] == plain.token_ids[0] == reference)
            bench.ticker.advance()
            _decode(engine, peers, prompts[-1], ids[-1], cfg.decode_tokens, 0, "", decode_rates)
            if cfg.peer_lookahead:
                k = cfg.peer_lookahead
                _decode(engine, peers, prompts[-1], ids[-1], cfg.decode_tokens, k, f" lookahead {k}", decode_rates)
                _decode(engine, peers, prompts[-2], ids[-2], cfg.decode_tokens, 0, "", decode_rates, "free: ")
                _decode(engine, peers, prompts[-2], ids[-2], cfg.decode_tokens, k, f" lookahead {k}", decode_rates,
                        "free: ")
            bench.ticker.advance()
    finally:
        peers.close()
    recomputed = len(ids[1]) - engine.complete(ids[1], max_new_tokens=1).cached_tokens  # never asked before
    return {"context_tokens": len(ids[0]), "question_tokens": len(ids[1]) - common_prefix(ids[0], ids[1]),
            "prefix_recomputed_tokens": recomputed,
            "seconds": {name: summarize(values) for name, values in samples.items()},
            "decode_tokens_per_s": {name: summarize(values) for name, values in decode_rates.items()},
            "first_token_agrees": sum(agree), "rounds": len(agree)}


def _decode(engine, peers: _Setups, prompt: str, ids: list[int], tokens: int, lookahead: int, suffix: str,
            rates: dict, prefix: str = "") -> None:
    """Greedy tokens/s after ``prompt`` on every llama.cpp set-up but Q4_1 and flash attention
    (plain decode: all of them) and on promptcache's module and prefix paths, with ``lookahead``."""
    def decode(peer):
        peer.hit(ids)
        return peer.decode(tokens, lookahead)

    for label, answer in peers.each(decode, LOOKAHEAD_SETUPS if lookahead else None).items():
        rates.setdefault(f"{prefix}{label}{suffix}", []).append((len(answer["tokens"]) - 1) / answer["seconds"])
    engine.lookahead = lookahead
    try:
        decoded = engine.generate(prompt, max_new_tokens=tokens)
        rates.setdefault(f"{prefix}promptcache module{suffix}", []).append(
            (len(decoded.token_ids) - 1) / max(decoded.total_s - decoded.ttft_s, 1e-9))
        plain = engine.complete(ids, max_new_tokens=tokens)
        rates.setdefault(f"{prefix}promptcache prefix{suffix}", []).append(
            (len(plain.token_ids) - 1) / max(plain.total_s - plain.ttft_s, 1e-9))
    finally:
        engine.lookahead = 0
