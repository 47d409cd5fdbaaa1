"""``promptcache bench``: the performance suite of a source checkout (``python -m perf``).

The suite lives in ``perf/`` beside the package, not in the installed package; this command
finds it from an editable install or the current directory and hands it its arguments.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

import pckernels

CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
"""Every argument, ``--help`` included, goes to the suite's own parser."""


def suite_root() -> Path | None:
    """The checkout holding ``perf/suite``: above the package, else the current directory."""
    for root in (Path(pckernels.__file__).resolve().parents[1], Path.cwd()):
        if (root / "perf" / "suite" / "cli.py").is_file():
            return root
    return None


def bench(ctx: typer.Context) -> None:
    """Run the performance suite (arguments as `python -m perf`; `promptcache bench --help` lists them)."""
    root = suite_root()
    if root is None:
        typer.echo("error: the performance suite (perf/suite) ships with the source checkout; run this from it",
                   err=True)
        raise typer.Exit(2)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from perf.suite.cli import main

    raise typer.Exit(main(list(ctx.args)))
