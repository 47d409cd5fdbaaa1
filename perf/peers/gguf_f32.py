"""The embedded model's GGUF with every tensor dequantized to F32, for llama.cpp as a peer.

The shipped file is Q4_1 (a few tensors Q8_0/F32); llama.cpp has no fast matmul for Q4_1 on
every CPU, and promptcache runs the same weights dequantized to fp32, so the fair comparison is
the same F32 weights on both sides. The metadata (tokenizer, architecture, hyper-parameters) is
copied unchanged; only ``general.file_type`` becomes ``ALL_F32``.
"""

from __future__ import annotations

import logging
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


def embedded_f32(cache_dir: str | Path | None = None) -> Path:
    """The F32 GGUF of the embedded model, made once under promptcache's cache directory."""
    from pckernels.integration.embedded import cache_root, gguf_path

    source = gguf_path()
    target = Path(cache_dir or cache_root() / "models") / (source.stem.split(".")[0] + ".F32.gguf")
    if not target.is_file():
        write_f32(source, target)
    return target
