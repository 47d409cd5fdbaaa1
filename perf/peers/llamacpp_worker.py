"""llama.cpp (through llama-cpp-python) as a measured peer, in its own interpreter.

llama-cpp-python is compiled from source into a separate virtual environment (it is never a
dependency of promptcache), so :mod:`perf.peers.llamacpp` runs this module with that
environment's Python and talks to it over stdin/stdout, one JSON object per line:

``{"op": "load", "model": PATH, "n_ctx": N, "threads": T, "flash_attn": bool, "kv": "f16"|"f32"}``
``{"op": "prefill", "ids": [...]}``: a cold read of ``ids`` (the cache cleared first);
``{"op": "hit", "keep": K, "ids": [...]}``: keep the first ``K`` cached tokens (llama.cpp's own
prefix reuse, as its server does) and read the rest of ``ids``;
``{"op": "decode", "n": N}``: ``N`` greedy tokens one forward at a time after the last read.

Each answer carries the seconds measured inside the worker (no pipe overhead) and the greedy
tokens chosen, so both engines can be checked to answer the same token ids.
"""

from __future__ import annotations

import json
import sys
import time


def _argmax(llm) -> int:
    """The greedy token after the last read (the logits of its last token; llama-cpp-python keeps
    no scores without ``logits_all``)."""
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def main() -> None:
    import llama_cpp

    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "load":
                kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[request.get("kv", "f16")]
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
