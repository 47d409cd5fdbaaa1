"""Model identity for cache keys: a digest that changes when any weight changes.

Blocks encoded by one model must never be reused by another, and two fine-tunes of one base
model share config, names and shapes, so the identity covers every byte of every weight:

* a model loaded from weight files (``PromptCache.from_pretrained``) is identified by the
  SHA-256 of those files, computed once per file and remembered by path, size and mtime in
  ``<cache_root>/identity.json`` (later loads cost a ``stat`` per file);
* a model handed over in memory is identified by the SHA-256 of each parameter's and
  buffer's bytes (name, dtype and shape included), hashed in a thread pool.

Either way the config and the dtype the engine runs in are part of the identity.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files whose bytes make up a model's weights in a model directory."""

_CHUNK = 8 << 20
_memo_lock = threading.Lock()


def _memo_path() -> Path:
    from pckernels.integration.embedded import cache_root

    return cache_root() / "identity.json"


def _read_memo(path: Path) -> dict:
    try:
        memo = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(path: Path, memo: dict) -> None:
    """Replace the memo file atomically; a failure (read-only or full disk) only costs a rehash later."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".identity-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(memo, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not remember weight digests in %s: %s", path, exc)


def file_digest(path: str | os.PathLike, *, memo_path: Path | None = None) -> str:
    """SHA-256 of a file's bytes, remembered by resolved path, size and mtime (an edited or
    replaced file is hashed again)."""
    path = Path(path).resolve()
    st = path.stat()
    memo_path = memo_path or _memo_path()
    stamp = [st.st_size, st.st_mtime_ns]
    with _memo_lock:
        entry = _read_memo(memo_path).get(str(path))
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    with _memo_lock:
        memo = _read_memo(memo_path)
        memo[str(path)] = {"stamp": stamp, "sha256": digest}
        _write_memo(memo_path, memo)
    log.debug("hashed %s (%d bytes)", path, st.st_size)
    return digest


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The weight files of a model directory (``WEIGHT_SUFFIXES``), sorted; empty if none."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    h = hashlib.sha256(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
    data = tensor.detach().contiguous().cpu().reshape(-1)
    if data.numel():
        h.update(memoryview(data.view(torch.uint8).numpy()))
    return h.digest()


def tensors_digest(model: torch.nn.Module, *, threads: int | None = None) -> str:
    """SHA-256 over every parameter and buffer of ``model`` (names, dtypes, shapes and bytes).
    hashlib releases the GIL on large buffers, so tensors are hashed in parallel."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda item: _tensor_digest(*item), named))
    h = hashlib.sha256()
    for digest in digests:
        h.update(digest)
    return h.hexdigest()


def model_fingerprint(model: torch.nn.Module, dtype: torch.dtype,
                      files: Iterable[str | os.PathLike] | None = None) -> str:
    """Identity of ``model`` running in ``dtype`` for cache keys (32 hex digits).

    ``files``: the weight files it was loaded from, unmodified since; their digests stand for the
    weights (cheap after the first time). Without them every tensor is hashed."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    h.update(str(dtype).encode())
    files = list(files or ())
    if files:
        for path in files:
            h.update(f"{Path(path).name}:{file_digest(path)}".encode())
    else:
        h.update(tensors_digest(model).encode())
    return h.hexdigest()[:32]
