"""What the server uses of its engine: :class:`ServingEngine`, the part of
:class:`~pckernels.engine.PromptCache` the routes, the schema registry and the metrics call."""

from __future__ import annotations

import os
from typing import Any, Callable, Protocol

from pckernels.engine.request import Request, RequestHandle
from pckernels.generation import SamplingParams
from pckernels.pml.model import Schema


class ServingEngine(Protocol):
    """An engine the server can serve (``PromptCache`` is one; ``tests/test_serving_engine.py`` checks it)."""

    @property
    def name(self) -> str:
        """The model's name: what ``/v1/models`` serves unless ``--served-model-name`` says otherwise."""

    @property
    def model_id(self) -> str:
        """The model's fingerprint (the start of ``system_fingerprint``)."""

    @property
    def max_positions(self) -> int | None:
        """The longest context the model takes (``max_model_len`` in ``/v1/models``)."""

    @property
    def grammars(self) -> Any:
        """Compiles response formats and guided-decoding constraints (``pckernels.generation.grammar.Grammars``)."""

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer, to decode streamed tokens."""

    def request(self, prompt: str, params: SamplingParams | None = None, *, recompute: float | None = None,
                recompute_policy: str | None = None, deadline_s: float | None = None, salt: str = "") -> Request:
        """Parse and plan a PML prompt against ``salt``'s schemas, its tokens chosen by ``params``; bad
        input raises and changes nothing."""

    def complete_request(self, prompt: str | list[int] | list[dict[str, str]], params: SamplingParams | None = None,
                         *, reuse: bool = True, deadline_s: float | None = None, salt: str = "",
                         tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> Request:
        """A plain prompt (text, token ids or chat messages) as a request with exact prefix reuse, its
        tokens chosen by ``params``; ``chat_template_kwargs``: extra chat-template variables."""

    def prompt_logprobs(self, prompt, top: int = 0, *, tools: list[dict] | None = None) -> tuple[list[int], list]:
        """The prompt's token ids and their log-probabilities (``TokenLogprob``; the first's is
        None) with ``top`` alternatives, from one cold forward (``echo`` with ``logprobs``)."""

    def submit(self, request: Request) -> RequestHandle:
        """Queue ``request`` on the scheduler and return its handle at once."""

    def parse_schema(self, text_or_path: str | os.PathLike, *, salt: str = "") -> Schema:
        """Parse a schema into ``salt``'s namespace without encoding it; ``PMLError`` on bad input."""

    def install_schema(self, schema: Schema, *, on_progress: Callable[[int, int], None] | None = None) -> Schema:
        """Encode a parsed schema and add it to its namespace, reporting ``on_progress(done, total)``."""

    def warm_schema(self, schema: Schema) -> int:
        """Start background reads of the schema's blocks only the remote tier holds; returns how many."""

    def remove_schema(self, name: str, *, salt: str = "") -> bool:
        """Forget a schema of ``salt``'s namespace; ``False`` when there was none."""

    def stats(self) -> dict:
        """The store's, the scheduler's (under ``"engine"``) and the prefix cache's counters."""

    def close(self) -> None:
        """Stop the scheduler and the store's background work."""
