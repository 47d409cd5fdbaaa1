"""``promptcache eval``: the fidelity evaluation (``perf/fidelity``) from the command line.

The evaluation, its data set and its results live in the source checkout's ``perf/`` folder,
which is not installed with the package; this command finds it next to the package.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

_CHECKOUT = Path(__file__).resolve().parents[1]


def register(app: typer.Typer) -> None:
    """Add the ``eval`` command to ``app``."""

    @app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                           "help_option_names": []})
    def eval_command(ctx: typer.Context) -> None:
        """Fidelity of modular reuse vs baseline on the shipped document-QA set (options: --help,
        --quick, --limit N, --shares ..., --policies ..., --max-new-tokens, --out)."""
        if not (_CHECKOUT / "perf" / "fidelity" / "runner.py").is_file():
            typer.echo("promptcache eval needs a source checkout (perf/fidelity next to the package)", err=True)
            raise typer.Exit(2)
        if str(_CHECKOUT) not in sys.path:
            sys.path.insert(0, str(_CHECKOUT))
        from perf.fidelity.runner import main

        raise typer.Exit(main(list(ctx.args)))
