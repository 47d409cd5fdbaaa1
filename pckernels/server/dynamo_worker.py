"""promptcache's engine as an NVIDIA Dynamo worker (``promptcache dynamo-worker``).

Dynamo's frontend (``python -m dynamo.frontend``) serves the OpenAI API: it renders the chat
template, tokenizes, picks a worker (``--router-mode kv`` scores each by the prompt blocks it
holds, known from its KV events, and by the prefill and decode work it has in flight) and
detokenizes. A worker serves one token-in/token-out endpoint: it receives Dynamo's
``PreprocessedRequest`` (``token_ids``, ``sampling_options``, ``stop_conditions``,
``output_options``) and streams ``LLMEngineOutput`` dicts (``index``, ``token_ids``,
``log_probs``, ``top_logprobs``, ``finish_reason``, ``completion_usage`` with the cached prompt
tokens). Here that endpoint is :meth:`DynamoHandler.generate` over a :class:`PromptCache`'s
scheduler (plain prompts through exact prefix reuse); the engine's vLLM-format KV events
(``pckernels.store.events``) are relayed to Dynamo's router by Dynamo's own ``KvEventPublisher``.

Everything but :func:`serve` runs without Dynamo installed (``ai-dynamo`` and
``ai-dynamo-runtime``, docs/fleet.md), so the request mapping is tested everywhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from pckernels.engine.request import RequestHandle
from pckernels.errors import OptionError
from pckernels.generation import GenerationResult, SamplingParams
from pckernels.server.generation import Watcher
from pckernels.server.replies import finish_reason

log = logging.getLogger(__name__)

__all__ = ["DynamoHandler", "DynamoSettings", "model_folder", "sampling_from", "serve"]

DISCOVERY = ("etcd", "file", "mem", "kubernetes")
REQUEST_PLANES = ("tcp", "nats")
EVENT_PLANES = ("zmq", "nats")
_ENDPOINT = re.compile(r"^dyn://([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


@dataclass(frozen=True)
class DynamoSettings:
    """Where the worker registers, as Dynamo's own workers take it: ``endpoint``
    (``dyn://namespace.component.endpoint``), ``model_name`` the frontend serves it as (``None``:
    the model's name), ``discovery_backend`` (etcd, file, mem, kubernetes), ``request_plane``
    (tcp, nats), ``event_plane`` (zmq, nats; ``None``: Dynamo's choice for the discovery backend).
    A bad value raises :class:`OptionError` naming the field."""

    endpoint: str = "dyn://dynamo.backend.generate"
    model_name: str | None = None
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    event_plane: str | None = None

    def __post_init__(self) -> None:
        if not _ENDPOINT.match(self.endpoint):
            raise OptionError("endpoint", self.endpoint, "dyn://namespace.component.endpoint (letters, digits, "
                              "- and _ in each part)")
        for name, choices in (("discovery_backend", DISCOVERY), ("request_plane", REQUEST_PLANES)):
            if getattr(self, name) not in choices:
                raise OptionError(name, getattr(self, name), "one of " + ", ".join(choices), choices=choices)
        if self.event_plane is not None and self.event_plane not in EVENT_PLANES:
            raise OptionError("event_plane", self.event_plane, "one of " + ", ".join(EVENT_PLANES),
                              choices=EVENT_PLANES)

    @property
    def path(self) -> str:
        """``namespace.component.endpoint``, as ``DistributedRuntime.endpoint`` takes it."""
        return self.endpoint[len("dyn://"):]


def sampling_from(request: dict, grammars=None, *, default_max_tokens: int = 512) -> SamplingParams:
    """The :class:`SamplingParams` of a Dynamo ``PreprocessedRequest`` dict.

    ``sampling_options``: temperature, top_p, top_k, min_p, seed, n, presence/frequency/repetition
    penalties, ``guided_decoding`` (json, regex, choice or grammar, compiled by ``grammars``);
    ``stop_conditions``: max_tokens (absent: ``default_max_tokens``), min_tokens, ignore_eos,
    ``stop_token_ids_hidden`` (ids that end the answer); stop strings are the frontend's to apply;
    ``output_options``: logprobs. Beam search, ``best_of`` > n and prompt logprobs are refused
    (:class:`OptionError`, as is any value :class:`SamplingParams` refuses).
    """
    sampling = request.get("sampling_options") or {}
    stop = request.get("stop_conditions") or {}
    output = request.get("output_options") or {}
    if sampling.get("use_beam_search"):
        raise OptionError("use_beam_search", True, "false: promptcache does not search beams")
    n = sampling.get("n") or 1
    if (sampling.get("best_of") or n) > n:
        raise OptionError("best_of", sampling["best_of"], f"at most n ({n})")
    if output.get("prompt_logprobs") not in (None, 0, ""):
        raise OptionError("prompt_logprobs", output["prompt_logprobs"], "absent: a worker does not return "
                          "prompt log-probabilities (promptcache serve does: completions with echo)")
    fields: dict[str, Any] = {"max_new_tokens": stop.get("max_tokens") or default_max_tokens, "n": n}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if sampling.get(name) is not None:
            fields[name] = sampling[name]
    if stop.get("min_tokens"):
        fields["min_tokens"] = stop["min_tokens"]
    if stop.get("ignore_eos"):
        fields["ignore_eos"] = True
    if stop.get("stop_token_ids_hidden"):
        fields["stop_token_ids"] = tuple(stop["stop_token_ids_hidden"])
    if output.get("logprobs") is not None:
        fields["logprobs"] = int(output["logprobs"])
    guided = sampling.get("guided_decoding")
    if guided:
        fields["grammar"] = _grammar(guided, grammars)
    return SamplingParams(**fields)


def _grammar(guided: dict, grammars):
    """A compiled constraint from Dynamo's ``guided_decoding`` (one of json, regex, choice, grammar)."""
    given = {k: v for k, v in guided.items() if k in ("json", "regex", "choice", "grammar") and v is not None}
    if len(given) != 1 or grammars is None:
        raise OptionError("guided_decoding", guided, "exactly one of json, regex, choice, grammar")
    (kind, value), = given.items()
    if kind == "json":
        kind, value = "json_schema", json.loads(value) if isinstance(value, str) else value
    return grammars.compile(kind, value)


def _usage(result: GenerationResult) -> dict:
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def _logprobs(records: list, tokenizer) -> tuple[list[float], list[list[dict]]]:
    """Dynamo's ``log_probs`` (one float per token) and ``top_logprobs`` (per token its alternatives,
    best first) of the :class:`~pckernels.generation.TokenLogprob` records of a chunk."""
    chosen = [float(r.logprob) for r in records]
    top = [[{"rank": rank, "token_id": int(token), "logprob": float(lp),
             "token": tokenizer.decode([int(token)]) if tokenizer is not None else None}
            for rank, (token, lp) in enumerate(r.top, start=1)] for r in records]
    return chosen, top


class DynamoHandler:
    """Dynamo's ``generate`` endpoint over ``engine`` (a :class:`~pckernels.engine.PromptCache`).

    ``observe(result, handle)``: called as each answer ends (a benchmark's counters); ``salt``:
    the prefix-block namespace of every request (the frontend has no tenants)."""

    def __init__(self, engine, *, default_max_tokens: int = 512, salt: str = "",
                 observe: Callable[[GenerationResult, RequestHandle], None] | None = None) -> None:
        self.engine = engine
        self.default_max_tokens = default_max_tokens
        self.salt = salt
        self.observe = observe

    def _submit(self, request: dict) -> RequestHandle:
        ids = request.get("token_ids")
        if not ids:
            raise OptionError("token_ids", ids, "a non-empty list of token ids")
        params = sampling_from(request, getattr(self.engine, "grammars", None),
                               default_max_tokens=self.default_max_tokens)
        return self.engine.submit(self.engine.complete_request([int(t) for t in ids], params, salt=self.salt))

    async def generate(self, request: dict, context=None) -> AsyncIterator[dict]:
        """Stream the answers of one request: chunks of new token ids per answer (``index``), the
        last chunk of each with its ``finish_reason`` (``stop``, ``length``, ``cancelled`` or
        ``error: …``) and usage. The token that ends an answer (``RequestHandle.final_emitted``) is
        held until the answer's result is in, so it travels with the finish reason, as vLLM's workers
        send it: Dynamo's frontend ends the stream at a stop id, and a usage sent after it would be
        lost. A bad request ends at once with ``error: …`` and queues nothing."""
        try:
            handle = await asyncio.to_thread(self._submit, request)
        except Exception as exc:  # noqa: BLE001 — bad input: the answer is the error
            log.info("refused a request: %s", exc)
            yield {"index": 0, "token_ids": [], "finish_reason": f"error: {exc}"}
            return
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        watchers = [Watcher(choice, loop, event) for choice in handle.choices]
        sent = [0] * len(watchers)
        held: list[list[int]] = [[] for _ in watchers]
        open_ = set(range(len(watchers)))
        try:
            while open_:
                if context is not None and context.is_stopped():
                    for choice in handle.choices:
                        choice.cancel()
                    for index in sorted(open_):
                        yield {"index": index, "token_ids": [], "finish_reason": "cancelled"}
                    return
                moved = False
                for index in sorted(open_):
                    answer = watchers[index].handle
                    ended = answer.done  # read before taking: every token of an ended answer is queued
                    tokens, held[index] = held[index] + answer.take(), []
                    if ended:
                        moved = True
                        open_.discard(index)
                        yield self._end(index, answer, tokens, sent[index])
                    elif tokens and answer.final_emitted:
                        held[index] = tokens
                    elif tokens:
                        moved = True
                        yield self._chunk(index, answer, tokens, sent[index])
                        sent[index] += len(tokens)
                if not moved:
                    await watchers[0].wait(0.25)
        finally:
            for choice in handle.choices:
                if not choice.done:
                    choice.cancel()

    def _chunk(self, index: int, answer: RequestHandle, tokens: list[int], sent: int) -> dict:
        chunk: dict[str, Any] = {"index": index, "token_ids": tokens}
        records = answer.logprobs[sent:sent + len(tokens)]
        if records and len(records) == len(tokens):
            chunk["log_probs"], chunk["top_logprobs"] = _logprobs(records, self.engine.tokenizer)
        return chunk

    def _end(self, index: int, answer: RequestHandle, tokens: list[int], sent: int) -> dict:
        chunk = self._chunk(index, answer, tokens, sent)
        try:
            result = answer.result(timeout=0)
        except Exception as exc:  # noqa: BLE001 — the answer failed: Dynamo says so to the client
            log.warning("request %d failed: %s", answer.id, exc)
            chunk["finish_reason"] = f"error: {exc}"
            return chunk
        if self.observe is not None:
            self.observe(result, answer)
        chunk["finish_reason"] = finish_reason(result.finish_reason)
        chunk["completion_usage"] = _usage(result)
        return chunk


def model_folder(model: str, root: Path) -> Path:
    """A folder Dynamo reads ``model``'s card from (``config.json`` naming its ``architectures``,
    the tokenizer's files): the model's own folder when its config names them, else a copy of its
    config (``architectures`` filled in from ``model_type``) beside links to its tokenizer files,
    under ``root``. ``model``: ``smollm2``, a fetched model's name, a local folder, or a hub id in
    the local hub cache."""
    source = _source_folder(model)
    config = json.loads((source / "config.json").read_text())
    if config.get("architectures"):
        return source
    folder = root / "model-card"
    folder.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (source / name).exists() and not (folder / name).exists():
            shutil.copy(source / name, folder / name)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = config.get("model_type") or "llama"
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind, kind.capitalize() + "ForCausalLM")]
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=1))
    return folder


def _source_folder(model: str) -> Path:
    from pckernels.integration import embedded, fetched

    if model == "smollm2":
        return embedded.converted_dir()
    if fetched.is_fetchable(model):
        return fetched.converted_dir(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))


async def serve(engine, settings: DynamoSettings, *, model: str, events_endpoint: str | None, work_dir: Path,
                handler: DynamoHandler | None = None) -> None:
    """Register ``engine`` with Dynamo and serve its endpoint until the process ends.

    ``events_endpoint``: where the engine's KV-event publisher is bound (Dynamo's relay connects
    to it; ``None``: no events, Dynamo's router then predicts what a worker holds); ``work_dir``: where a model card folder is written when one is needed."""
    from dynamo._core import (DistributedRuntime, KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType,
                              WorkerType, register_model)

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, settings.discovery_backend, settings.request_plane,
                                 event_plane=settings.event_plane)
    endpoint = runtime.endpoint(settings.path)
    block = engine.prefix_block_size
    relay = None if events_endpoint is None else KvEventPublisher(endpoint, kv_block_size=block,
                                                                    zmq_endpoint=events_endpoint)
    handler = handler or DynamoHandler(engine)
    runtime_config = ModelRuntimeConfig()
    runtime_config.max_num_seqs = engine.config.max_batch
    runtime_config.max_num_batched_tokens = engine.config.step_tokens
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint,
                         str(model_folder(model, work_dir)), settings.model_name or model,
                         worker_type=WorkerType.Aggregated, kv_cache_block_size=block, runtime_config=runtime_config)
    _stop_on_signals(loop, runtime, endpoint)
    log.info("serving %s at %s (%s discovery, %s requests), KV events relayed from %s", model, settings.endpoint,
             settings.discovery_backend, settings.request_plane, events_endpoint)
    try:
        await endpoint.serve_endpoint(handler.generate)
    finally:
        del relay


def _stop_on_signals(loop, runtime, endpoint) -> None:
    """SIGTERM / SIGINT end the worker as Dynamo's own workers end: its endpoint withdrawn from
    discovery first (the frontend stops routing to it), a grace period
    (``$DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS``, 5 s) for what is in flight, then the runtime shut
    down, so :func:`serve` returns and the command cleans up."""
    try:
        from dynamo.common.utils.graceful_shutdown import install_signal_handlers
    except ImportError:  # an older Dynamo: stop at once
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runtime.shutdown)
        return
    install_signal_handlers(loop, runtime, [endpoint])
