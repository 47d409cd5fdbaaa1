"""llama.cpp (through llama-cpp-python) as a measured peer, in its own interpreter.

llama-cpp-python is compiled from source into a separate virtual environment (it is never a
dependency of promptcache), so :mod:`perf.peers.llamacpp` runs this module with that
environment's Python and talks to it over stdin/stdout, one JSON object per line:

``{"op": "load", "model": PATH, "n_ctx": N, "threads": T, "flash_attn": bool, "kv": "f16"|"f32",
"repack": bool}`` (``repack: false`` is llama.cpp's ``--no-repack``: no extra buffer types, so no
AMX or other repacked weight kernels);
``{"op": "prefill", "ids": [...]}``: a cold read of ``ids`` (the cache cleared first);
``{"op": "hit", "keep": K, "ids": [...]}``: keep the first ``K`` cached tokens (llama.cpp's own
prefix reuse, as its server does) and read the rest of ``ids``;
``{"op": "decode", "n": N}``: ``N`` greedy tokens one forward at a time after the last read;
``{"op": "decode", "n": N, "lookahead": K}``: the same tokens with promptcache's prompt-lookup
drafts (:mod:`pckernels.engine.lookahead`, loaded from its file: this interpreter has no torch)
verified in one forward each, the rejected rows dropped from llama.cpp's cache.

Each answer carries the seconds measured inside the worker (no pipe overhead) and the greedy
tokens chosen, so both engines can be checked to answer the same token ids.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import sys
import time
from pathlib import Path

LOOKAHEAD = Path(__file__).resolve().parents[2] / "pckernels" / "engine" / "lookahead.py"


@contextlib.contextmanager
def _repacking(llama_cpp, repack: bool):
    """While loading: llama.cpp's model defaults, with ``use_extra_bufts`` (weight repacking) off
    when ``repack`` is False — llama-cpp-python's ``Llama`` takes no argument for it. This process
    loads one model at a time, so swapping the default for the duration is safe."""
    if repack:
        yield
        return
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def no_repack():
        params = default()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = no_repack
    try:
        yield
    finally:
        low.llama_model_default_params = default


def _argmax(llm) -> int:
    """The greedy token after the last read (the logits of its last token; llama-cpp-python keeps
    no scores without ``logits_all``)."""
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


@functools.cache
def _lookahead_module():
    spec = importlib.util.spec_from_file_location("promptcache_lookahead", LOOKAHEAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _drafter(tokens: list[int]):
    return _lookahead_module().NgramDrafter(tokens)


def _eval_rows(llm, tokens: list[int]) -> list[int]:
    """Read ``tokens`` after the cache in one forward with logits for every row (``Llama.eval``
    keeps only the last row's); the greedy token after each."""
    import numpy as np

    llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
    past = llm.n_tokens
    llm._batch.set_batch(batch=tokens, n_past=past, logits_all=True)
    llm._ctx.decode(llm._batch)
    llm.input_ids[past:past + len(tokens)] = tokens
    llm.n_tokens += len(tokens)
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(tokens), llm.n_vocab()))
    return [int(t) for t in logits.argmax(axis=1)]


def _decode_lookahead(llm, n: int, lookahead: int) -> list[int]:
    """``n`` greedy tokens, each step verifying a prompt-lookup draft as promptcache's scheduler
    does (the same drafter and the same halving/doubling of its length)."""
    tokens = [_argmax(llm)]
    drafter = _drafter([int(t) for t in llm.input_ids[:llm.n_tokens]] + tokens)
    room = lookahead
    while len(tokens) < n:
        drafts = drafter.propose(min(room, n - len(tokens) - 1))
        chosen = _eval_rows(llm, [tokens[-1]] + drafts)
        accepted = 0
        for index, token in enumerate(chosen):
            tokens.append(token)
            drafter.extend([token])
            if len(tokens) >= n or index == len(drafts) or token != drafts[index]:
                break
            accepted += 1
        llm.n_tokens -= len(drafts) - accepted  # the next read drops the rejected rows' KV
        if drafts and accepted == len(drafts):
            room = min(lookahead, 2 * room)
        elif drafts and accepted == 0:
            room = max(1, room // 2)
    return tokens[:n]


def main() -> None:
    import llama_cpp

    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "load":
                kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[request.get("kv", "f16")]
                with _repacking(llama_cpp, request.get("repack", True)):
                    llm = llama_cpp.Llama(model_path=request["model"], n_ctx=request["n_ctx"], type_k=kv, type_v=kv,
                                          n_threads=request["threads"], n_threads_batch=request["threads"],
                                          n_batch=512, n_ubatch=512, flash_attn=request["flash_attn"],
                                          logits_all=False, verbose=False)
                answer = {"version": llama_cpp.__version__}
            elif op == "prefill":
                llm.reset()
                llm._ctx.kv_cache_clear()
                t0 = time.perf_counter()
                llm.eval(request["ids"])
                answer = {"seconds": time.perf_counter() - t0, "token": _argmax(llm)}
            elif op == "hit":
                keep = request["keep"]
                ids = request["ids"]
                if list(llm._input_ids[:keep]) != ids[:keep] or llm.n_tokens < keep:
                    raise ValueError("the cached tokens do not start with the kept prefix")
                t0 = time.perf_counter()
                llm.n_tokens = keep
                llm._ctx.kv_cache_seq_rm(-1, keep, -1)
                llm.eval(ids[keep:])
                answer = {"seconds": time.perf_counter() - t0, "token": _argmax(llm)}
            elif op == "decode" and request.get("lookahead"):
                t0 = time.perf_counter()
                tokens = _decode_lookahead(llm, request["n"], request["lookahead"])
                answer = {"seconds": time.perf_counter() - t0, "tokens": tokens}
            elif op == "decode":
                tokens = [_argmax(llm)]
                t0 = time.perf_counter()
                for _ in range(request["n"] - 1):
                    llm.eval([tokens[-1]])
                    tokens.append(_argmax(llm))
                answer = {"seconds": time.perf_counter() - t0, "tokens": tokens}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # reported to the driver, which fails the run
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
