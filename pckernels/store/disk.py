"""The disk tier: one safetensors file per block, named by the key's digest.

Layout: ``<root>/v<FORMAT_VERSION>/<digest[:2]>/<digest>.safetensors`` holding one tensor
``"kv"`` ``[L, 2, H, n, D]`` and string metadata: ``format``, ``key`` (the full digest),
``sha256`` (over the tensor's bytes) and descriptive fields (model, schema, module, scaffold,
tokens). There is no index: a file's name is its key, so processes sharing the directory need no
lock. Files are written to a temporary name in the same directory and renamed into place
(``os.replace`` is atomic), so a reader sees a whole file or none. A directory that cannot be
used, or a write that fails (disk full, file too large, no permission), turns the tier off with a
warning: its partial file is removed and blocks stay in memory only. A file that is truncated,
fails its checksum, belongs to another key/format, or holds a tensor of another shape or dtype than
its key expects is logged, deleted and reported as a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from pckernels.store.blocks import DTYPES, BlockFileError, TierStats, check_expected, tensor_bytes
from pckernels.store.events.ledger import NO_PLACE
from pckernels.store.keys import FORMAT_VERSION, BlockKey
from pckernels.store.policy import CostModel, make_policy

log = logging.getLogger(__name__)

FILE_FORMAT = f"promptcache-kv/{FORMAT_VERSION}"
SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 3600.0
MAX_HEADER = 1 << 20


def checksum(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def write_block(path: Path, key: BlockKey, block: torch.Tensor) -> int:
    """Write ``block`` (CPU) atomically to ``path``; returns the file size in bytes."""
    block = block.contiguous()
    metadata = {"format": FILE_FORMAT, "key": key.digest, "sha256": checksum(block), **key.describe()}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        save_file({"kv": block}, tmp, metadata=metadata)
        size = os.path.getsize(tmp)
        os.replace(tmp, path)
    except BaseException:
        _unlink(Path(tmp))
        raise
    return size


def _unlink(path: Path) -> None:
    """Delete ``path`` if it exists; a directory that vanished or cannot be written is no error here."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def read_header(path: Path) -> tuple[dict, int]:
    """``(header, data_start)`` of a safetensors file; raises ``BlockFileError`` if unreadable."""
    with open(path, "rb") as f:
        return _read_header(f, os.fstat(f.fileno()).st_size)


def _read_header(f, file_size: int) -> tuple[dict, int]:
    head = f.read(8)
    if len(head) < 8:
        raise BlockFileError("truncated header")
    n = int.from_bytes(head, "little")
    if n > min(MAX_HEADER, file_size - 8):
        raise BlockFileError("truncated or corrupt header")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockFileError(f"corrupt header ({exc})") from None
    if not isinstance(header, dict):
        raise BlockFileError("corrupt header")
    return header, 8 + n


def read_block(path: Path, digest: str, *, pin: bool = False, shape: tuple[int | None, ...] | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Read and verify the block of key ``digest`` into CPU memory (pinned when ``pin``); when
    given, its ``shape`` (``None`` entries match any size) and ``dtype`` must be those expected.

    Raises ``FileNotFoundError`` when absent and ``BlockFileError`` when the file must not be used.
    """
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        header, data_start = _read_header(f, file_size)
        meta = header.get("__metadata__") or {}
        if meta.get("format") != FILE_FORMAT:
            raise BlockFileError(f"foreign file (format {meta.get('format')!r})")
        if meta.get("key") != digest:
            raise BlockFileError(f"foreign file (holds key {str(meta.get('key'))[:16]}…)")
        try:
            info = header["kv"]
            stored_dtype = DTYPES[info["dtype"]]
            stored_shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BlockFileError(f"corrupt header ({exc!r})") from None
        check_expected(stored_shape, stored_dtype, shape, dtype)
        tensor = torch.empty(stored_shape, dtype=stored_dtype, pin_memory=pin)
        view = tensor_bytes(tensor)
        if end - begin != view.nbytes:
            raise BlockFileError("corrupt header (shape and offsets disagree)")
        if data_start + end != file_size:
            raise BlockFileError(f"truncated ({file_size} bytes, header says {data_start + end})")
        f.seek(data_start + begin)
        if f.readinto(memoryview(view)) != view.nbytes:
            raise BlockFileError("truncated data")
    if hashlib.sha256(view).hexdigest() != meta.get("sha256"):
        raise BlockFileError("checksum mismatch")
    return tensor


@dataclass
class DiskStats(TierStats):
    """The disk tier's counters (``TieredStore.stats()["disk"]``)."""

    loads: int = 0
    load_s: float = 0.0
    evictions: int = 0
    skipped: int = 0
    """Blocks larger than the whole disk budget, not written."""


class DiskTier:
    """Block files under ``root`` within ``budget`` bytes (as seen by this process).

    The budget counts the files this process knows: those present at start-up (scanned, oldest
    modification time evicted first) plus those it wrote or found since. Loading a file bumps its
    modification time so that other processes' scans see it as recently used.

    ``off``: why the tier is off (``None`` while on). It goes off, with a warning, when its
    directory cannot be created (a file is in the way, no permission) or a write fails (disk full);
    from then on it holds nothing: reads miss and writes are refused.

    ``events``: the KV-event :class:`~pckernels.store.events.Place` told what files it gains and
    loses (a file found at start is named to it once its key is used).
    """

    def __init__(self, root: str | os.PathLike, budget: int, *, policy: str = "gds",
                 cost: CostModel = CostModel(20e-3, 50e6)) -> None:
        self.root = Path(root)
        self.dir = self.root / f"v{FORMAT_VERSION}"
        if int(budget) < 0:
            raise ValueError(f"disk budget must not be negative, got {budget!r}")
        self.budget = int(budget)
        self._policy_args = (policy, cost)
        self.policy = make_policy(policy, cost)
        self.stats = DiskStats()
        self._sizes: dict[str, int] = {}
        self.nbytes = 0
        self.off: str | None = None
        self.events = NO_PLACE
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.turn_off(f"cannot use directory {self.root}: {exc}")
            return
        self._scan()

    def turn_off(self, reason: str) -> None:
        """Stop using the disk: forget every file (they stay where they are) and refuse further I/O."""
        log.warning("disk tier off: %s; encoded blocks are kept in memory only", reason)
        self.off = reason
        self._sizes.clear()
        self.events.drop_all()
        self.nbytes = 0
        self.policy = make_policy(*self._policy_args)

    def path(self, digest: str) -> Path:
        return self.dir / digest[:2] / f"{digest}{SUFFIX}"

    def _scan(self) -> None:
        found = []
        now = time.time()
        for path in self.dir.glob(f"*/*{SUFFIX}") if self.dir.is_dir() else ():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if path.name.startswith(TEMP_PREFIX):
                if now - st.st_mtime > STALE_TEMP_S:
                    path.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, path.name[:-len(SUFFIX)], st.st_size))
        for _, digest, size in sorted(found):
            self._track(digest, size)

    def _track(self, digest: str, size: int, key: BlockKey | None = None) -> None:
        self._sizes[digest] = size
        self.nbytes += size
        self.policy.admit(digest, size)
        self.events.hold(digest, key.info if key is not None else None)

    def _forget(self, digest: str, *, notify: bool = True) -> None:
        size = self._sizes.pop(digest, None)
        if size is not None:
            self.nbytes -= size
            self.policy.remove(digest)
            if notify:
                self.events.drop(digest)

    def __contains__(self, key: BlockKey) -> bool:
        if key.digest in self._sizes:
            if key.info is not None:
                self.events.hold(key.digest, key.info)
            return True
        if self.off is not None:
            return False
        try:
            size = self.path(key.digest).stat().st_size
        except OSError:
            return False
        self._track(key.digest, size, key)
        self._evict_to(self.budget, keep=key.digest)
        return key.digest in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size_of(self, key: BlockKey) -> int:
        return self._sizes.get(key.digest, 0)

    def read_raw(self, key: BlockKey, pin: bool) -> tuple[torch.Tensor | Exception, float]:
        """Read without touching this tier's bookkeeping (safe from a loader thread):
        ``(block or the exception, seconds)``; hand the result to ``accept``."""
        t0 = time.perf_counter()
        try:
            outcome: torch.Tensor | Exception = read_block(self.path(key.digest), key.digest, pin=pin,
                                                           shape=key.shape, dtype=key.dtype)
        except (OSError, BlockFileError) as exc:
            outcome = exc
        return outcome, time.perf_counter() - t0

    def accept(self, key: BlockKey, result: tuple[torch.Tensor | Exception, float]) -> torch.Tensor | None:
        """Book a ``read_raw`` result: the block, or ``None`` (absent or discarded)."""
        outcome, seconds = result
        if isinstance(outcome, torch.Tensor):
            self.stats.loads += 1
            self.stats.load_s += seconds
            if self.off is not None:
                return outcome
            if key.digest not in self._sizes:
                try:
                    self._track(key.digest, os.path.getsize(self.path(key.digest)), key)
                except OSError:
                    return outcome
            elif key.info is not None:
                self.events.hold(key.digest, key.info)
            self.policy.touch(key.digest)
            try:
                os.utime(self.path(key.digest))
            except OSError:
                pass
            return outcome
        if isinstance(outcome, BlockFileError):
            self.discard(key, str(outcome))
        else:
            self._forget(key.digest)
            if not isinstance(outcome, FileNotFoundError):
                log.warning("cannot read block %s (%s): %s", key.label, key.digest[:16], outcome)
        return None

    def read(self, key: BlockKey, *, pin: bool = False) -> torch.Tensor | None:
        """The verified block, or ``None`` when absent or unusable (then it is deleted) or the tier is off."""
        if self.off is not None:
            return None
        return self.accept(key, self.read_raw(key, pin))

    def discard(self, key: BlockKey, reason: str) -> None:
        log.warning("discarding block file %s for %s: %s; it will be re-encoded",
                    self.path(key.digest), key.label or key.digest[:16], reason)
        self.stats.discard(reason)
        self._forget(key.digest)
        _unlink(self.path(key.digest))

    def write(self, key: BlockKey, block: torch.Tensor) -> bool:
        """Write ``block`` (any device), then delete other files until the budget holds again.
        Returns whether the block is now on disk. A failed write (disk full, …) leaves no partial
        file and turns the tier off."""
        if self.off is not None:
            return False
        if block.numel() * block.element_size() > self.budget:
            self.stats.skipped += 1
            return False
        known = key.digest in self._sizes
        self._forget(key.digest, notify=False)
        t0 = time.perf_counter()
        try:
            size = write_block(self.path(key.digest), key, block.detach().to("cpu"))
        except (OSError, SafetensorError) as exc:
            if known:
                self.events.drop(key.digest)
            self.turn_off(f"cannot write block {key.label} to {self.dir}: {exc}")
            return False
        self.stats.writes += 1
        self.stats.write_s += time.perf_counter() - t0
        self._track(key.digest, size, key)
        self._evict_to(self.budget, keep=key.digest)
        return key.digest in self._sizes

    def _evict_to(self, limit: int, keep: str | None = None) -> None:
        """Delete files until at most ``limit`` bytes are held (``keep`` goes last)."""
        while self.nbytes > limit and self._sizes:
            digest = self.policy.victim()
            if digest == keep and len(self._sizes) > 1:
                self.policy.touch(digest)
                continue
            self._forget(digest)
            _unlink(self.path(digest))
            self.stats.evictions += 1

    def describe(self) -> dict:
        """Counters and state for ``TieredStore.stats()``."""
        s = self.stats
        return {"enabled": self.off is None, "off_reason": self.off, "hits": s.hits, "entries": len(self),
                "bytes": self.nbytes, "budget": self.budget, "evictions": s.evictions, "loads": s.loads,
                "load_s": s.load_s, "writes": s.writes, "write_s": s.write_s, "discarded": s.discarded,
                "discard_reasons": dict(s.reasons), "skipped": s.skipped, "dir": str(self.root)}

    def clear(self) -> int:
        """Delete every block file (and temporary file) under this tier; returns files removed."""
        removed = 0
        for path in self.dir.glob("*/*") if self.dir.is_dir() else ():
            if path.name.endswith(SUFFIX):
                path.unlink(missing_ok=True)
                removed += not path.name.startswith(TEMP_PREFIX)
        self._sizes.clear()
        self.events.drop_all()
        self.nbytes = 0
        self.policy = make_policy(*self._policy_args)
        return removed


def list_blocks(root: str | os.PathLike) -> list[dict]:
    """Descriptions of the block files under ``root`` (unreadable files are reported as such)."""
    out = []
    base = Path(root) / f"v{FORMAT_VERSION}"
    for path in sorted(base.glob(f"*/*{SUFFIX}")) if base.is_dir() else ():
        if path.name.startswith(TEMP_PREFIX):
            continue
        entry = {"path": str(path), "digest": path.name[:-len(SUFFIX)]}
        try:
            st = path.stat()
            header, _ = read_header(path)
        except (OSError, BlockFileError) as exc:
            entry.update(status=f"unreadable: {exc}", bytes=0, mtime=0.0)
            out.append(entry)
            continue
        meta = header.get("__metadata__") or {}
        entry.update({k: meta.get(k, "") for k in ("model", "schema", "module", "scaffold", "tokens")},
                     bytes=st.st_size, mtime=st.st_mtime, status="ok")
        out.append(entry)
    return out
