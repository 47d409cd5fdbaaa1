"""Content-addressed keys for encoded module blocks.

A block's KV depends on the model, the tokens it holds and where they sit, and what they
attended to while being encoded. The key hashes exactly that, as a chain:

    key(module)            = H(format, model, tokenizer, device kind, key(parent), own tokens/positions)
    key(member @ scaffold) = H(..., key(parent), own tokens/positions, peers' tokens/positions)

so a module's key changes when (and only when) its own content, its position, or any ancestor's
content changes. Module, schema and scaffold names are not part of the key: they are carried
along (not compared) for logs and listings. Editing one module therefore leaves the keys of
modules outside its subtree (and layout) untouched.

A *packed* block (``geometry="packed"``, read by compact placement: ``pckernels.pml.placement``) is
encoded with its unit right after the anonymous text before it. Its key hashes that text (tokens
and positions) instead of the root's key, and no schema offset, so the same module after the same
text in two schemas is one block.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from pckernels.pml.model import ROOT, Schema
from pckernels.pml.placement import encoded_positions, root_before, unit_span
from pckernels.store.events.ledger import BlockInfo, digest_hash, salt_tag

FORMAT_VERSION = 1
"""Bump when the block layout ``[L, 2, H, n, D]`` or the encoding procedure changes."""

MEMO_SCHEMAS = 64
"""Schema versions whose keys ``BlockKeys`` keeps memoized (least recently used dropped first)."""


@dataclass(frozen=True)
class BlockKey:
    """Identity of one encoded block: ``digest`` (sha256 hex) is the whole identity; the other
    fields describe it (listings, logs, checks on load) and never take part in equality.

    ``shape`` / ``dtype``: what the block must be, checked when it is read from disk (``None``:
    unchecked; a ``None`` inside ``shape``: any size along that dimension). ``info``: how KV events
    name the block (:class:`~pckernels.store.events.BlockInfo`; ``None``: unnamed, not published).
    """

    digest: str
    model: str = field(default="", compare=False)
    schema: str = field(default="", compare=False)
    module: str = field(default="", compare=False)
    scaffold: str = field(default="", compare=False)
    tokens: int = field(default=0, compare=False)
    shape: tuple[int | None, ...] | None = field(default=None, compare=False)
    dtype: torch.dtype | None = field(default=None, compare=False)
    geometry: str = field(default="schema", compare=False)
    info: BlockInfo | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """``schema:module`` (``@scaffold`` when encoded jointly); the root is ``(root)``."""
        name = f"{self.schema}:{self.module or '(root)'}"
        name = f"{name}@{self.scaffold}" if self.scaffold else name
        return f"{name}+packed" if self.geometry == "packed" else name

    def describe(self) -> dict[str, str]:
        """The descriptive fields as strings (stored in file metadata)."""
        return {"model": self.model, "schema": self.schema, "module": self.module,
                "scaffold": self.scaffold, "tokens": str(self.tokens)}


def _content(token_ids: tuple[int, ...], position_ids: tuple[int, ...]) -> list[list[int]]:
    return [list(token_ids), list(position_ids)]


class BlockKeys:
    """Makes (and memoizes) the keys of one engine: fixed model, tokenizer and device kind.

    ``model_id`` must identify config, weights and dtype; ``tokenizer_id`` the vocabulary and
    rules; ``device_kind`` (``"cpu"``, ``"cuda"``) separates numerics of different kernels so a
    reload is bit-identical to the original encode. ``layout`` (layers, KV heads, head size) and
    ``dtype``, when given, set each key's expected block ``shape`` and ``dtype``.

    The memo holds the keys of at most ``memo_schemas`` schema versions (by digest, least recently
    used dropped first) and one version per schema name: keying a new version of a name drops the
    old one's keys. A dropped version's keys are simply made again if it is used again.
    """

    def __init__(self, model_id: str, tokenizer_id: str, device_kind: str, model_name: str = "", *,
                 layout: tuple[int, int, int] | None = None, dtype: torch.dtype | None = None,
                 memo_schemas: int = MEMO_SCHEMAS) -> None:
        self.layout = layout
        self.dtype = dtype
        self._prefix = json.dumps({"format": FORMAT_VERSION, "model": model_id, "tokenizer": tokenizer_id,
                                   "device": device_kind}, sort_keys=True)
        self.model_name = model_name
        self.memo_schemas = memo_schemas
        self._memo: OrderedDict[str, tuple[str, dict[tuple[str, str, str], BlockKey]]] = OrderedDict()
        self._lock = threading.RLock()
        """schema digest -> (schema name, (module, scaffold, geometry) -> key), most recently used last."""

    def __call__(self, schema: Schema, module: str, scaffold: str = "", geometry: str = "schema") -> BlockKey:
        with self._lock:
            return self._key(schema, module, scaffold, "schema" if module == ROOT else geometry)

    def _key(self, schema: Schema, module: str, scaffold: str, geometry: str = "schema") -> BlockKey:
        memo = self._memo_of(schema)
        key = memo.get((module, scaffold, geometry))
        if key is None:
            key = memo[(module, scaffold, geometry)] = self._make(schema, module, scaffold, geometry)
        return key

    def memoized(self) -> dict[str, int]:
        """Keys held in the memo per schema version (``salt/digest``; the digest alone without a salt)."""
        return {digest: len(keys) for digest, (_, keys) in self._memo.items()}

    def _memo_of(self, schema: Schema) -> dict[tuple[str, str], BlockKey]:
        version = f"{schema.salt}/{schema.digest}" if schema.salt else schema.digest
        name = (schema.salt, schema.name)
        entry = self._memo.get(version)
        if entry is not None:
            self._memo.move_to_end(version)
            return entry[1]
        for old in [v for v, (n, _) in self._memo.items() if n == name]:
            del self._memo[old]
        while len(self._memo) >= max(1, self.memo_schemas):
            self._memo.popitem(last=False)
        keys: dict[tuple[str, str], BlockKey] = {}
        self._memo[version] = (name, keys)
        return keys

    def _make(self, schema: Schema, module: str, scaffold: str, geometry: str = "schema") -> BlockKey:
        mod = schema.modules[module]
        if geometry == "packed":
            scope = self._packed_scope(schema, module, scaffold)
        else:
            parent = self._key(schema, mod.parent, "").digest if mod.parent is not None else ""
            scope = {"parent": parent, "own": _content(mod.token_ids, mod.position_ids)}
            if schema.salt:
                scope["salt"] = schema.salt
            if scaffold:
                peers = [schema.modules[m] for m in schema.scaffolds[scaffold].members if m != module]
                peers.sort(key=lambda m: (m.position_ids[:1], m.token_ids))
                scope["peers"] = [_content(m.token_ids, m.position_ids) for m in peers]
        h = hashlib.sha256(self._prefix.encode())
        h.update(json.dumps(scope, separators=(",", ":")).encode())
        n = len(mod.token_ids)
        shape = None
        if self.layout is not None:
            layers, heads, head_dim = self.layout
            shape = (layers, 2, heads, n, head_dim)
        digest = h.hexdigest()
        parent_digest = scope.get("parent") or None
        info = BlockInfo(digest_hash(digest), digest_hash(parent_digest) if parent_digest else None,
                         tuple(mod.token_ids), n,
                         ("pml", schema.name, module, scaffold, geometry, salt_tag(schema.salt), digest))
        return BlockKey(digest, model=self.model_name, schema=schema.name, module=module,
                        scaffold=scaffold, tokens=n, shape=shape, dtype=self.dtype, geometry=geometry, info=info)

    def _packed_scope(self, schema: Schema, module: str, scaffold: str) -> dict[str, object]:
        """What a packed block depends on: the anonymous text before its unit (tokens and
        positions), its parent's packed block, its own tokens and its scaffold peers' at their
        packed positions — never where the unit sits in the schema."""
        mod = schema.modules[module]
        scope: dict[str, object] = {"geometry": "packed",
                                    "own": _content(mod.token_ids, encoded_positions(schema, module, "packed", scaffold))}
        if mod.parent not in (None, ROOT):
            scope["parent"] = self._key(schema, mod.parent, "", "packed").digest
        else:
            root = schema.modules[ROOT]
            count = root_before(schema, unit_span(schema, module, scaffold)[0])
            scope["context"] = _content(root.token_ids[:count], root.position_ids[:count])
        if scaffold:
            peers = [m for m in schema.scaffolds[scaffold].members if m != module]
            scope["peers"] = sorted(_content(schema.modules[m].token_ids,
                                             encoded_positions(schema, m, "packed", scaffold)) for m in peers)
        if schema.salt:
            scope["salt"] = schema.salt
        return scope
