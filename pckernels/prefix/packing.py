"""A stored entry of a model with recurrent layers as one byte tensor, and back.

A full block of a hybrid model holds keys and values for its attention layers only, and the
recurrent and convolution states at its end: tensors of several shapes (and possibly dtypes)
that no ``[L, 2, H, n, D]`` block can hold. :func:`pack` lays them out as one ``uint8`` tensor —
an 8-byte little-endian header length, a JSON header naming each part (layer, what, dtype,
shape) and the parts' bytes in that order — which the store's tiers (memory, disk, remote) keep
like any block. :func:`unpack` reads it back and refuses (``ValueError``) anything that does not
match the model's layer kinds and the block's token count, so a foreign or damaged blob is never
restored.
"""

from __future__ import annotations

import json

import torch

from pckernels.prefix.states import HYBRID, KV, LINEAR

_DTYPES = {str(dtype).removeprefix("torch."): dtype
           for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
HEADER_BYTES = 8


def pack(kv: list, states: list | None, device: torch.device) -> torch.Tensor:
    """``kv`` (per layer ``(keys, values)`` or None) and ``states`` (per layer None or one
    ``(conv, recurrent)`` pair per sub-state, each tensor or None) as a ``uint8`` tensor on ``device``."""
    parts: list[tuple[int, str, torch.Tensor]] = []
    for layer, pair in enumerate(kv):
        if pair is not None:
            parts += [(layer, "k", pair[0]), (layer, "v", pair[1])]
    for layer, pairs in enumerate(states or ()):
        for index, (conv, rec) in enumerate(pairs or ()):
            parts += [(layer, f"conv{index}", conv)] if conv is not None else []
            parts += [(layer, f"rec{index}", rec)] if rec is not None else []
    header = json.dumps([[layer, what, str(t.dtype).removeprefix("torch."), list(t.shape)]
                         for layer, what, t in parts]).encode()
    payload = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for _, _, t in parts]
    size = torch.tensor(list(len(header).to_bytes(HEADER_BYTES, "little")), dtype=torch.uint8)
    blob = torch.cat([size, torch.frombuffer(bytearray(header), dtype=torch.uint8), *payload])
    return blob.to(device)


def unpack(blob: torch.Tensor, kinds: list[str], num_tokens: int, device: torch.device) -> tuple[list, list | None]:
    """``(kv, states)`` as :func:`pack` took them, on ``device``; ``ValueError`` when ``blob`` is not a
    block of ``num_tokens`` tokens of a model with these layer ``kinds``."""
    data = blob.to("cpu").reshape(-1)
    if data.dtype != torch.uint8 or data.numel() < HEADER_BYTES:
        raise ValueError("not a packed block")
    size = int.from_bytes(bytes(data[:HEADER_BYTES].tolist()), "little")
    if size > data.numel() - HEADER_BYTES:
        raise ValueError("truncated header")
    try:
        header = json.loads(bytes(data[HEADER_BYTES:HEADER_BYTES + size].tolist()))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable header: {exc}") from None
    kv: list = [None] * len(kinds)
    states: list = [None] * len(kinds)
    offset = HEADER_BYTES + size
    for layer, what, dtype_name, shape in header:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None or not 0 <= layer < len(kinds):
            raise ValueError(f"part {what!r} of layer {layer}: unknown dtype {dtype_name!r} or layer")
        count = dtype.itemsize * _numel(shape)
        if offset + count > data.numel():
            raise ValueError("truncated payload")
        tensor = data[offset:offset + count].clone().view(dtype).reshape(shape).to(device)
        offset += count
        if what in ("k", "v"):
            if kinds[layer] not in (KV, HYBRID) or len(shape) != 4 or shape[2] != num_tokens:
                raise ValueError(f"keys/values of layer {layer} do not fit a {num_tokens}-token block of this model")
            keys, values = kv[layer] or (None, None)
            kv[layer] = (tensor, values) if what == "k" else (keys, tensor)
        else:
            if kinds[layer] not in (LINEAR, HYBRID):
                raise ValueError(f"layer {layer} of this model has no recurrent state")
            index = int(what[4:] if what.startswith("conv") else what[3:])
            pairs = list(states[layer] or ())
            pairs += [(None, None)] * (index + 1 - len(pairs))
            conv, rec = pairs[index]
            pairs[index] = (tensor, rec) if what.startswith("conv") else (conv, tensor)
            states[layer] = tuple(pairs)
    if offset != data.numel():
        raise ValueError("trailing bytes")
    for layer, kind in enumerate(kinds):
        if kind in (KV, HYBRID) and (kv[layer] is None or None in kv[layer]):
            raise ValueError(f"keys/values of layer {layer} missing")
        if kind in (LINEAR, HYBRID) and states[layer] is None:
            return kv, None
    return kv, states


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
