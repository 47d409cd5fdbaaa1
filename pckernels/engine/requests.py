"""From what a caller asks to a :class:`~pckernels.engine.request.Request` the scheduler runs.

Runs in the caller's thread, so bad input raises there and changes nothing: a PML prompt (or a
prompt program's call) is resolved against the schemas its salt sees, checked (answerable,
movable when placed compactly, within the model's positions), its stale tokens selected for
recompute and planned for its mode (:mod:`~pckernels.engine.plan`); a plain prompt (text, token
ids, chat messages) is tokenized and checked for length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pckernels.engine.blocks import ModuleBlocks
from pckernels.engine.namespaces import SchemaNamespaces
from pckernels.engine.plan import (RequestPlan, default_recompute, last_cached_token, plan_request,
                                   plan_request_baseline, plan_request_reference, select_recompute)
from pckernels.engine.request import PrefixPrefill, Request
from pckernels.errors import PMLPromptTooLongError
from pckernels.generation import SamplingParams
from pckernels.pml import check_answerable
from pckernels.pml.model import ROOT, ResolvedPrompt, Schema
from pckernels.prefix.prompts import encode_prompt
from pckernels.program import ProgramCall

MODES = ("cached", "reference", "baseline")


def deadline_at(seconds: float | None) -> float | None:
    """The ``time.monotonic()`` value ``seconds`` from now (None: no deadline)."""
    if seconds is None:
        return None
    if seconds <= 0:
        raise ValueError(f"deadline_s must be positive, got {seconds}")
    return time.monotonic() + seconds


class RequestBuilder:
    """Builds requests for one engine (module docstring). ``namespaces()``: its schemas (raises a
    ``PMLError`` on a model that cannot reuse modules); ``scores(schema)``: its deviation scores
    (the ``deviation`` recompute policy); ``check_length(n)``: raises when a plain prompt of ``n``
    tokens leaves no position to generate at."""

    def __init__(self, tokenizer: Any, max_positions: int | None, namespaces: Callable[[], SchemaNamespaces],
                 blocks: ModuleBlocks | None, scores: Callable[[Schema], dict],
                 check_length: Callable[[int], None]) -> None:
        self.tokenizer = tokenizer
        self.max_positions = max_positions
        self.namespaces = namespaces
        self.blocks = blocks
        self.scores = scores
        self.check_length = check_length

    def pml(self, prompt: str | ResolvedPrompt | ProgramCall, params: SamplingParams, *, mode: str,
            recompute: float | None, recompute_policy: str | None, deadline: float | None, salt: str,
            submitted: float) -> Request:
        """A PML prompt (or a program's call) resolved with ``salt`` and planned for ``mode``."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        resolved = self.namespaces().resolve(prompt, salt=salt)
        check_answerable(resolved)
        if resolved.placement == "compact" and mode != "baseline":
            self.blocks.check_movable(resolved.locations.get(ROOT, (None, None)), "the prompt is placed compactly",
                                      resolved.label)
        limit = self.max_positions
        last_pos = resolved.last_position if mode != "baseline" else len(resolved.token_ids) - 1
        if limit is not None and last_pos + 1 >= limit:
            raise PMLPromptTooLongError(last_pos, limit)
        if mode == "baseline" and recompute:
            raise ValueError("recompute applies to the cached and reference modes, not baseline")
        recompute, recompute_policy = default_recompute(resolved.placement if mode != "baseline" else "schema",
                                                        recompute, recompute_policy)
        recomputed = select_recompute(resolved, recompute, recompute_policy, lambda: self.scores(resolved.schema))
        last = last_cached_token(resolved) if mode != "baseline" else None
        if last is not None:
            recomputed = recomputed | {last}
        if mode == "baseline":
            plan: RequestPlan = plan_request_baseline(resolved)
            positions = list(range(len(resolved.token_ids)))
        elif mode == "reference":
            plan = plan_request_reference(resolved, recomputed)
            positions = list(resolved.position_ids)
        else:
            plan = plan_request(resolved, recomputed)
            positions = list(resolved.position_ids)
        return Request(params, mode, list(resolved.token_ids), positions, plan=plan, schema=resolved.schema,
                       deadline=deadline, submitted=submitted)

    def plain(self, prompt, params: SamplingParams, *, reuse: bool, deadline: float | None, salt: str,
              submitted: float, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> Request:
        """A plain prompt (text, token ids, chat messages or a program's rendered call) for exact
        prefix reuse; ``salt`` namespaces its prefix blocks; ``tools``: function definitions the
        chat template renders with the messages, with ``template_kwargs`` (extra template variables)."""
        if isinstance(prompt, ProgramCall):
            prompt = prompt.render(self.tokenizer)
        ids = encode_prompt(self.tokenizer, prompt, tools, template_kwargs)
        self.check_length(len(ids))
        return Request(params, "prefix", list(ids), list(range(len(ids))), prefix=PrefixPrefill(list(ids), reuse, salt),
                       deadline=deadline, submitted=submitted)
