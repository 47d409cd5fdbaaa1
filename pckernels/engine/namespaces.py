"""The engine's schemas, by namespace: parsing, installing (encoding), removing, resolving prompts.

A namespace is a salt (a server's tenant; ``""`` is the default one). A schema lives in the
namespace it was added with; a prompt resolved with a salt sees its namespace's schemas, then the
default namespace's for names it does not define. Installing a schema encodes its modules (through
the :class:`~pckernels.engine.encoder.ModuleEncoder`) before it becomes visible; a prompt
program's schema is installed on its first call.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import ChainMap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pckernels.engine.blocks import ModuleBlocks
from pckernels.engine.encoder import ModuleEncoder
from pckernels.errors import PMLError
from pckernels.pml import parse_prompt, parse_schema
from pckernels.pml.model import ResolvedPrompt, Schema
from pckernels.program import ProgramCall

log = logging.getLogger(__name__)


def geometries_for(schema: Schema) -> tuple[str, ...]:
    """The encodings ``add_schema`` makes for ``schema``'s modules: packed ones when its prompts are
    placed compactly by default, else schema ones (a prompt asking for the other encodes what it
    reads on first use)."""
    return ("packed",) if schema.placement == "compact" else ("schema",)


def read_source(text_or_path: str | os.PathLike) -> tuple[str | bytes, Path | None]:
    """Schema text (a file's raw bytes, decoded by the PML layer) and its base directory (for
    ``src=``); accepts PML text or a file path."""
    if isinstance(text_or_path, os.PathLike) or (
            isinstance(text_or_path, str) and "<" not in text_or_path and len(text_or_path) < 4096):
        path = Path(text_or_path)
        try:
            return path.read_bytes(), path.resolve().parent
        except OSError as exc:
            raise PMLError(f"cannot read schema file {str(path)!r}: {exc.strerror or exc}") from None
    return str(text_or_path), None


class SchemaNamespaces:
    """Schemas by salt and name (module docstring). ``tokenizer`` and ``max_positions`` lay
    schemas out; ``encoder`` encodes them; ``blocks`` checks that compact placement can move them.
    ``placement``: the placement of a schema whose ``<schema>`` tag names none (compact falls back
    to schema placement, logged once, on a model whose cached keys cannot move)."""

    def __init__(self, tokenizer: Any, max_positions: int | None, encoder: ModuleEncoder,
                 blocks: ModuleBlocks, placement: str = "compact") -> None:
        self.tokenizer = tokenizer
        self.max_positions = max_positions
        self.encoder = encoder
        self.blocks = blocks
        self.placement = placement
        self._default_placement: str | None = None
        self.default: dict[str, Schema] = {}
        """Schemas of the default namespace (salt ``""``) by name."""
        self._spaces: dict[str, dict[str, Schema]] = {"": self.default}
        self._lock = threading.Lock()
        self._install_lock = threading.Lock()
        self._program_lock = threading.Lock()

    def parse(self, text_or_path: str | os.PathLike, *, salt: str = "") -> Schema:
        """Parse (and lay out) a schema without encoding or adding it; ``PMLError`` on bad input."""
        text, base_dir = read_source(text_or_path)
        schema = parse_schema(text, self.tokenizer, base_dir=base_dir, max_positions=self.max_positions,
                              placement=self.default_placement())
        schema.salt = salt
        return schema

    def default_placement(self) -> str:
        """The placement schemas get when they name none: ``placement``, or schema placement
        when that is compact and this model cannot move cached modules (probed once)."""
        if self._default_placement is None:
            placement = self.placement
            if placement == "compact":
                rotation = self.blocks.key_rotation()
                if not rotation.movable:
                    log.warning("compact placement needs cached modules to move to other positions, which this "
                                "model cannot do (%s); schemas use schema placement", rotation.reason)
                    placement = "schema"
            self._default_placement = placement
        return self._default_placement

    def install(self, schema: Schema, *, progress: bool = False,
                on_progress: Callable[[int, int], None] | None = None) -> Schema:
        """Encode a parsed schema and add it to its salt's namespace, replacing a schema of the
        same name there once encoded; the same schema again encodes nothing."""
        previous = self.schemas_for(schema.salt, shared=False).get(schema.name)
        if previous is not None and previous.digest == schema.digest:
            return previous
        if schema.placement == "compact":
            self.blocks.check_movable(schema.location, f"schema {schema.name!r} asks for placement=\"compact\"")
        with self._install_lock:
            self.encoder.forget(schema.name, schema.salt)
            self.encoder.encode_schema(schema, progress=progress, on_progress=on_progress,
                                       geometries=geometries_for(schema))
        with self._lock:
            self._spaces.setdefault(schema.salt, {})[schema.name] = schema
        return schema

    def remove(self, name: str, *, salt: str = "") -> bool:
        """Forget a schema of a namespace (its blocks stay in the store until evicted); False when
        there was none. Requests already running keep it."""
        with self._lock:
            space = self._spaces.get(salt, {})
            removed = space.pop(name, None) is not None
            if salt and not space:
                self._spaces.pop(salt, None)
        if removed:
            self.encoder.forget(name, salt)
        return removed

    def schemas_for(self, salt: str = "", *, shared: bool = True) -> Mapping[str, Schema]:
        """The schemas a prompt resolved with ``salt`` sees: its namespace's, then (``shared``)
        the default namespace's for names it does not define. A snapshot."""
        with self._lock:
            own = dict(self._spaces.get(salt, {}))
            if not salt or not shared:
                return own
            return ChainMap(own, dict(self.default))

    def resolve(self, prompt: str | ResolvedPrompt | ProgramCall, *, salt: str = "") -> ResolvedPrompt:
        """Parse a PML prompt against the schemas ``salt`` sees; a prompt program's call against
        its own schema, installed on first use."""
        if isinstance(prompt, ResolvedPrompt):
            return prompt
        if isinstance(prompt, ProgramCall):
            return self._resolve_program(prompt, salt)
        return parse_prompt(prompt, self.schemas_for(salt))

    def _resolve_program(self, call: ProgramCall, salt: str) -> ResolvedPrompt:
        """Check the call's arguments, install its program's schema once (encoding it; concurrent
        first calls wait for one install) and resolve its prompt. Bad arguments change nothing."""
        call.check(self.tokenizer)
        schema = self.schemas_for(salt, shared=False).get(call.schema_name)
        if schema is None or schema.source != call.schema:
            with self._program_lock:
                schema = self.schemas_for(salt, shared=False).get(call.schema_name)
                if schema is None or schema.source != call.schema:
                    parsed = self.parse(call.schema, salt=salt)
                    parse_prompt(call.prompt, {parsed.name: parsed})
                    schema = self.install(parsed)
        return parse_prompt(call.prompt, {schema.name: schema})

    def warm(self, schema: Schema) -> int:
        """Start background reads of ``schema``'s blocks that only the remote tier holds; returns
        how many."""
        return self.encoder.warm(schema, geometries_for(schema))
