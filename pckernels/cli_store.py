"""``promptcache encode`` and ``promptcache cache ls | du | clear``: the module store's disk tier."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from pckernels.cli_common import MODEL_HELP, PLACEMENT_HELP, console, engine_settings, fail, load_engine

cache_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Inspect or clear the encoded-module files on disk.")

_STORE_DIR_HELP = "Block directory (default: $PROMPTCACHE_CACHE_DIR/kv or the XDG cache dir)."


def _store_dir(value: Optional[Path]) -> Path:
    from pckernels.store import default_store_dir

    return value if value is not None else default_store_dir()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def encode(schema: Path = typer.Argument(..., help="Schema file to encode."),
           model: str = typer.Option("smollm2", help=MODEL_HELP),
           store_dir: Optional[Path] = typer.Option(None, help=_STORE_DIR_HELP),
           remote: Optional[str] = typer.Option(None, help="Also upload the blocks to this Redis/Valkey server "
                                                           "(redis://host:port/db) or cluster "
                                                           "(redis+cluster://host:port[,...]) for a fleet."),
           remote_namespace: str = typer.Option("promptcache", help="Key prefix in the --remote server."),
           device: Optional[str] = typer.Option(None, help="cpu, cuda, … (default: best available)."),
           dtype: Optional[str] = typer.Option(None, help="float32, bfloat16, float16."),
           placement: str = typer.Option("compact", help=PLACEMENT_HELP + " (which encoding is stored)")) -> None:
    """Encode every module of SCHEMA and keep the blocks on disk (and in --remote) for later runs."""
    directory = _store_dir(store_dir)
    config = engine_settings(model, device=device, dtype=dtype, store_dir=directory, remote=remote,
                             remote_namespace=remote_namespace, placement=placement)
    if not schema.is_file():
        fail(f"no such schema file: {str(schema)!r}")
    if directory.exists() and not directory.is_dir():
        fail(f"--store-dir {str(directory)!r} is a file, not a directory")
    cache = load_engine(model, config)
    t0 = time.perf_counter()
    try:
        parsed = cache.add_schema(schema, progress=True)
    except (OSError, ValueError) as exc:
        fail(exc)
    if remote is not None:
        from pckernels.engine.namespaces import geometries_for

        cache.store.share(cache.encoder.block_keys(parsed, geometries_for(parsed)))
        cache.store.flush()
    seconds = time.perf_counter() - t0
    stats = cache.stats()
    if remote is not None:
        r = stats["remote"]
        console.print(escape(f"remote {r['url']}: {r['writes']} blocks uploaded ({r['bytes_written'] / 2**20:.1f} MiB), "
                             f"{r['present']} already there, {r['dropped_writes']} not written"
                             + (f"; down: {r['down_reason']}" if not r["up"] else "")))
    if not stats["disk"]["enabled"]:
        fail(f"nothing kept on disk: {stats['disk']['off_reason']}", code=1)
    units = sum(m.cached for m in parsed.modules.values()) + sum(len(s.members) for s in parsed.scaffolds.values())
    console.print(escape(f"schema {parsed.name!r} on {cache.name}: {units} blocks, {stats['encodes']} encoded "
                         f"in {stats['encode_s']:.2f} s, {units - stats['encodes']} already on disk "
                         f"({seconds:.2f} s in all); {directory}"))


@cache_app.command("ls")
def cache_ls(store_dir: Optional[Path] = typer.Option(None, help=_STORE_DIR_HELP)) -> None:
    """List the block files: model, schema, module, scaffold, tokens, size, age."""
    from pckernels.store import list_blocks

    entries = list_blocks(_store_dir(store_dir))
    table = Table(title=escape(f"{len(entries)} blocks in {_store_dir(store_dir)}"))
    for col in ("model", "schema", "module", "scaffold", "tokens", "size", "age", "key"):
        table.add_column(col, justify="right" if col in ("tokens", "size", "age") else "left")
    now = time.time()
    for e in sorted(entries, key=lambda e: (e.get("model", ""), e.get("schema", ""), e.get("module", ""))):
        if e["status"] != "ok":
            table.add_row("?", "?", escape(e["status"]), "", "", "", "", escape(e["digest"][:12]))
            continue
        age = now - e["mtime"]
        table.add_row(*(escape(str(e[k])) for k in ("model", "schema")), escape(e["module"] or "(root)"),
                      escape(str(e["scaffold"])), escape(str(e["tokens"])), _human(e["bytes"]),
                      f"{age / 3600:.1f} h" if age >= 3600 else f"{age / 60:.0f} min", escape(e["digest"][:12]))
    console.print(table)


@cache_app.command("du")
def cache_du(store_dir: Optional[Path] = typer.Option(None, help=_STORE_DIR_HELP)) -> None:
    """Disk use per model and in total."""
    from pckernels.store import list_blocks

    per_model: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in list_blocks(_store_dir(store_dir)):
        row = per_model[e.get("model") or "?"]
        row[0] += 1
        row[1] += e["bytes"]
    for name, (files, size) in sorted(per_model.items()):
        console.print(f"{_human(size):>10}  {files:5d} blocks  {escape(str(name))}")
    total = sum(size for _, size in per_model.values())
    console.print(f"{_human(total):>10}  {sum(f for f, _ in per_model.values()):5d} blocks  total "
                  f"({escape(str(_store_dir(store_dir)))})")


@cache_app.command("clear")
def cache_clear(store_dir: Optional[Path] = typer.Option(None, help=_STORE_DIR_HELP),
                yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation.")) -> None:
    """Delete every block file."""
    from pckernels.store import DiskTier

    directory = _store_dir(store_dir)
    if not yes:
        typer.confirm(f"delete every block file under {directory}?", abort=True)
    removed = DiskTier(directory, budget=0).clear() if directory.is_dir() else 0
    console.print(escape(f"removed {removed} block files from {directory}"))
