"""llama.cpp as a peer: finding an interpreter that has llama-cpp-python, and talking to it.

llama-cpp-python compiles llama.cpp from source (``CMAKE_ARGS=-DGGML_NATIVE=ON pip install
llama-cpp-python`` in a virtual environment of its own, 10-20 minutes); it is never installed by
promptcache or CI. :func:`find_python` looks for it in ``$PROMPTCACHE_LLAMACPP_PYTHON``, then in
the running interpreter; :class:`Peer` runs :mod:`perf.peers.llamacpp_worker` there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV_PYTHON = "PROMPTCACHE_LLAMACPP_PYTHON"


def _has_llama_cpp(python: str) -> str | None:
    """llama-cpp-python's version importable by ``python``, or None."""
    try:
        out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def find_python(explicit: str | None = None) -> tuple[str | None, str]:
    """``(python, version)`` of an interpreter with llama-cpp-python, or ``(None, why not)``."""
    candidates = [c for c in (explicit, os.environ.get(ENV_PYTHON), sys.executable) if c]
    for python in candidates:
        version = _has_llama_cpp(python)
        if version:
            return python, version
    return None, (f"llama-cpp-python is not importable by {', '.join(candidates)}; build it in a venv of its own "
                  f"(CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python) and set ${ENV_PYTHON}")


class Peer:
    """One llama.cpp worker process (see :mod:`perf.peers.llamacpp_worker`)."""

    def __init__(self, python: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen([python, "-m", "perf.peers.llamacpp_worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.cached: list[int] = []
        """Token ids the worker's KV cache holds (what a hit can keep)."""

    def _ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited (code {self.process.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"llama.cpp worker: {answer['error']}")
        return answer

    def load(self, model: Path, *, n_ctx: int, threads: int, flash_attn: bool, kv: str = "f16",
             repack: bool = True) -> str:
        """Load ``model`` with ``kv`` ("f16", llama.cpp's default, or "f32") as the KV cache type;
        ``repack=False`` is llama.cpp's ``--no-repack``."""
        self.cached = []
        return self._ask(op="load", model=str(model), n_ctx=n_ctx, threads=threads, flash_attn=flash_attn,
                         kv=kv, repack=repack)["version"]

    def died_of_sigill(self) -> bool:
        """The worker was killed by an illegal instruction (llama.cpp's AMX kernels, on a CPU that
        advertises AMX but cannot run it, as this VM's)."""
        return self.process.poll() == -signal.SIGILL

    def prefill(self, ids: list[int]) -> dict:
        """A cold read of ``ids``: seconds and the greedy next token."""
        answer = self._ask(op="prefill", ids=list(ids))
        self.cached = list(ids)
        return answer

    def hit(self, ids: list[int]) -> dict:
        """Read ``ids`` keeping the longest prefix the cache holds (llama.cpp's prefix reuse)."""
        keep = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)
        answer = self._ask(op="hit", keep=keep, ids=list(ids))
        answer["kept"] = keep
        self.cached = list(ids)
        return answer

    def decode(self, n: int, lookahead: int = 0) -> dict:
        """``n`` greedy tokens after the last read: seconds for the forwards after the first; with
        ``lookahead``, each verifying a prompt-lookup draft of up to that many tokens."""
        answer = self._ask(op="decode", n=n, lookahead=lookahead)
        self.cached = self.cached + answer["tokens"][:-1]
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
