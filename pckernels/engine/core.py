"""PromptCache: encode schema modules once, assemble them per prompt, generate."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Iterator

import torch
from transformers import DynamicCache

from pckernels.engine.buffer import AssemblyBuffer, BufferCache, Placement
from pckernels.engine.deviation import DeviationScores
from pckernels.engine.options import check_load_options, resolve_device, resolve_dtype
from pckernels.engine.plan import CachedPlan, plan_cached, plan_reference, select_recompute
from pckernels import ops
from pckernels.engine.result import GenerationResult
from pckernels.engine.sampling import StopChecker, make_generator, select_token
from pckernels.errors import PMLError, PMLPromptTooLongError
from pckernels.integration.adapters import AttentionSpec, ModelAdapter, adapter_for
from pckernels.integration.identity import model_fingerprint, weight_files
from pckernels.pml import check_answerable, parse_prompt, parse_schema
from pckernels.pml.model import ResolvedPrompt, Schema
from pckernels.pml.tokens import fingerprint
from pckernels.store import BlockKey, BlockKeys, TieredStore, default_store_dir, parse_budgets

log = logging.getLogger(__name__)

MODES = ("cached", "reference", "baseline")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU; bf16 on GPUs that support it, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class PromptCache:
    """Modular KV reuse over a HuggingFace causal LM.

    ``add_schema`` encodes every module of a PML schema once; ``generate`` answers a PML prompt
    by copying the imported modules' KV into a reusable buffer and computing only the new
    tokens. Modes: ``cached`` (the product), ``reference`` (the exactness oracle: one full forward
    with the module-scoped mask) and ``baseline`` (plain causal prefill, no reuse).

    Encoded blocks live in a ``TieredStore`` (``docs/store.md``): ``device_budget`` and
    ``host_budget`` bytes (or ``"2GiB"``-style strings; ``None``: a quarter of the GPU or 1 GiB on
    CPU, and 4 GiB), and a disk tier of ``disk_budget`` (default 20 GiB) in ``store_dir`` —
    none unless given here; ``from_pretrained`` turns it on by default. A negative or unreadable
    budget is a ``ValueError`` naming it, raised before the model is touched.

    ``model_id`` names the weights in cache keys; by default every tensor is hashed
    (:func:`pckernels.integration.identity.model_fingerprint`), ``from_pretrained`` hashes the
    weight files once instead.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, name: str | None = None,
                 store_dir: str | os.PathLike | None = None, device_budget: int | str | None = None,
                 host_budget: int | str | None = None, disk_budget: int | str | None = None,
                 model_id: str | None = None) -> None:
        budgets = parse_budgets(device_budget=device_budget, host_budget=host_budget, disk_budget=disk_budget)
        self.device = resolve_device(device) if device is not None else next(model.parameters()).device
        self.dtype = resolve_dtype(dtype) or next(model.parameters()).dtype
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        self.adapter: ModelAdapter = adapter_for(self.model)
        self.layout = self.adapter.kv_layout()
        self.model_id = model_id or model_fingerprint(self.model, self.dtype)
        self.store = TieredStore(self.device, disk_dir=store_dir, **budgets)
        self._block_keys = BlockKeys(self.model_id, fingerprint(tokenizer), self.device.type, self.name,
                                     layout=(self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim),
                                     dtype=self.dtype)
        self.schemas: dict[str, Schema] = {}
        self._block_positions: dict[str, dict[BlockKey, torch.Tensor]] = {}
        self.buffer = AssemblyBuffer(self.layout, dtype=self.dtype, device=self.device)
        self._cache = BufferCache(self.buffer)
        self._encode_buffer = AssemblyBuffer(self.layout, dtype=self.dtype, device=self.device)
        self._encode_cache = BufferCache(self._encode_buffer)
        self.deviation = DeviationScores(self)
        self._prefix = None
        eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = eos_ids

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2", *, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, store_dir: str | os.PathLike | bool | None = None,
                        device_budget: int | str | None = None, host_budget: int | str | None = None,
                        disk_budget: int | str | None = None) -> "PromptCache":
        """Load a model: ``"smollm2"`` is the embedded SmolLM2-135M-Instruct; otherwise a HF model
        id or local path (loaded offline from the local HF cache when no network is available).

        ``store_dir``: the disk tier's directory; ``None`` (or ``True``) is ``default_store_dir()``
        (``<cache_root>/kv``), ``False`` keeps blocks in memory only. Budgets as in the class.

        Bad options are refused before the model is loaded: a budget, an unknown or unavailable
        device or an unknown dtype with a ``ValueError``, a missing local model directory with a
        ``FileNotFoundError`` (``pckernels.engine.options``)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        parse_budgets(device_budget=device_budget, host_budget=host_budget, disk_budget=disk_budget)
        device, dtype = check_load_options(name_or_path, device, dtype)
        dev = device if device is not None else default_device()
        dt = dtype or default_dtype(dev)
        if name_or_path == "smollm2":
            from pckernels.integration import embedded

            tokenizer = embedded.load_tokenizer()
            model = embedded.load_model(dtype=dt)
            name = "SmolLM2-135M-Instruct"
            files = weight_files(embedded.converted_dir())
        else:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dt)
            name = str(name_or_path)
            files = _local_weight_files(str(name_or_path))
        adapter_for(model, attach=False)
        model_id = model_fingerprint(model, dt, files) if files else None
        if store_dir is None or store_dir is True:
            store_dir = default_store_dir()
        return cls(model, tokenizer, device=dev, dtype=dt, name=name, store_dir=store_dir or None,
                   device_budget=device_budget, host_budget=host_budget, disk_budget=disk_budget,
                   model_id=model_id)

    def add_schema(self, text_or_path: str | os.PathLike, *, progress: bool = False) -> Schema:
        """Parse a schema (PML text or a file path) and encode all of its modules and scaffolds.

        The same schema text again encodes nothing. Raises ``PMLError`` on bad input, leaving the
        cache unchanged.
        """
        text, base_dir = _read_source(text_or_path)
        schema = parse_schema(text, self.tokenizer, base_dir=base_dir, max_positions=self.adapter.max_positions())
        previous = self.schemas.get(schema.name)
        if previous is not None and previous.digest == schema.digest:
            return previous
        self._block_positions.pop(schema.name, None)
        self._encode_schema(schema, progress=progress)
        self.schemas[schema.name] = schema
        return schema

    def _block_key(self, schema: Schema, module: str, scaffold: str = "") -> BlockKey:
        return self._block_keys(schema, module, scaffold)

    def stats(self) -> dict:
        """The block store's counters: hits, entries, bytes, budget and evictions per tier (device,
        host, disk), misses, disk loads/writes/discards with their seconds, encodes and encode time;
        under ``"prefix"`` the prefix cache's counters once ``complete`` has been used."""
        out = self.store.stats()
        if self._prefix is not None:
            out["prefix"] = self._prefix.stats()
        return out

    @property
    def prefix(self):
        """The exact prefix cache over this model (:class:`pckernels.prefix.PrefixCache`), made on first use;
        full blocks it evicts spill into this engine's block store (``docs/prefix.md``)."""
        if self._prefix is None:
            from pckernels.prefix import PrefixCache

            self._prefix = PrefixCache(self.model, self.tokenizer, spill=self.store, spill_model_id=self.model_id)
        return self._prefix

    def complete(self, prompt, *, max_new_tokens: int = 64, reuse: bool = True, temperature: float = 0.0,
                 top_p: float = 1.0, stop: str | list[str] | None = None,
                 seed: int | None = None) -> GenerationResult:
        """Generate after any prompt — text, token ids or chat messages, no PML needed — reusing
        the longest cached prefix exactly (``docs/prefix.md``); ``reuse=False`` computes it all in
        the same chunks, so both give bitwise-equal first logits and equal greedy tokens."""
        return self.prefix.complete(prompt, max_new_tokens=max_new_tokens, reuse=reuse, temperature=temperature,
                                    top_p=top_p, stop=stop, seed=seed)

    @torch.inference_mode()
    def _encode_schema(self, schema: Schema, *, progress: bool) -> None:
        units: list[tuple[str, tuple[str, ...]]] = [("", (name,)) for name, m in schema.modules.items() if m.cached]
        units += [(s.name, s.members) for s in schema.scaffolds.values()]
        todo = [u for u in units if self._block_key(schema, u[1][0], u[0]) not in self.store]
        if not todo:
            return
        t0 = time.perf_counter()
        tokens = sum(len(schema.modules[m].token_ids) for _, members in todo for m in members)
        iterator = todo
        if progress:
            from rich.progress import track

            iterator = track(todo, description=f"encoding {schema.name}", transient=True)
        for scaffold, members in iterator:
            self._encode_unit(schema, scaffold, members)
        log.info("encoded %d blocks (%d tokens) of schema %r in %.2f s", len(todo), tokens, schema.name,
                 time.perf_counter() - t0)

    def _encode_unit(self, schema: Schema, scaffold: str, members: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Encode ``members`` (one module, or a scaffold's members jointly) over their ancestors'
        blocks, attending causally by position; store and return one block per member."""
        modules = schema.modules
        context = [a for a in reversed(modules[members[0]].ancestors(modules))]
        own = sorted(((p, t, m) for m in members for p, t in zip(modules[m].position_ids, modules[m].token_ids)))
        buf = self._encode_buffer
        ctx_rows = sum(len(modules[a].token_ids) for a in context)
        total = ctx_rows + len(own)
        buf.ensure_capacity(total)
        self._place_blocks(buf, schema, [(a, "") for a in context], start_row=0)
        t0 = time.perf_counter()
        if own:
            positions = torch.tensor([p for p, _, _ in own], dtype=torch.long, device=self.device)
            buf.row_pos[ctx_rows:total] = positions
            buf.row_bias[:total] = 0
            ids = torch.tensor([[t for _, t, _ in own]], dtype=torch.long, device=self.device)
            self._encode_cache.prepare(rows=None, start=ctx_rows, extent=total)
            self.adapter.forward(ids, positions[None], buf.attention(positions, total), self._encode_cache)
            buf.invalidate_rows(ctx_rows, total)
        offset = ctx_rows
        encoded = {}
        for member in members:
            n = len(modules[member].token_ids)
            rows = [offset + i for i, (_, _, m) in enumerate(own) if m == member]
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            block = buf.data.index_select(3, index) if n else buf.data[:, :, :, :0].clone()
            self.store.put(self._block_key(schema, member, scaffold), block)
            encoded[member] = block
        _sync(self.device)
        self.store.record_encode(len(members), time.perf_counter() - t0)
        return encoded

    def _place_blocks(self, buf: AssemblyBuffer, schema: Schema, blocks: list[tuple[str, str]],
                      start_row: int) -> None:
        """Put ``(module, scaffold)`` blocks in consecutive rows from ``start_row`` with one
        gather-concat over the row ranges that do not already hold them; set their positions.

        The blocks those rows lack are fetched from the store first (any that no tier holds is
        re-encoded, which uses the encode buffer and may displace rows there, hence the loop);
        the union siblings of the placed modules are then prefetched."""
        placements, row = [], start_row
        for module, scaffold in blocks:
            key = self._block_key(schema, module, scaffold)
            placements.append(Placement(key, 0, row, key.tokens))
            row += key.tokens
        fetched: dict[BlockKey, torch.Tensor] = {}
        while lacking := [(b, p.key) for b, p in zip(blocks, placements)
                          if p.n_rows and p.key not in fetched and buf.missing(p)]:
            for (module, scaffold), key in lacking:
                fetched[key] = self._fetch_block(schema, module, scaffold)
        sources: list[torch.Tensor] = []
        table: list[tuple[int, int, int, int]] = []
        for (module, _), placement in zip(blocks, placements):
            gaps = buf.missing(placement) if placement.n_rows else []
            if gaps:
                sources.append(fetched[placement.key])
                table.extend((len(sources) - 1, g.src_row, g.dst_row, g.n_rows) for g in gaps)
                buf.row_pos[placement.dst_row:placement.dst_row + placement.n_rows] = self._positions(
                    schema, module, placement.key)
                buf.mark_resident(placement)
        self.store.prefetch(self._block_key(schema, sibling) for sibling in _union_siblings(schema, blocks))
        if table:
            ops.gather_concat(buf.data, sources, torch.tensor(table, dtype=torch.int64))

    def _fetch_block(self, schema: Schema, module: str, scaffold: str) -> torch.Tensor:
        """The block ``[L, 2, H, n, D]`` from the store, re-encoded (its whole scaffold) if no tier holds it."""
        block = self.store.get(self._block_key(schema, module, scaffold))
        if block is None:
            members = schema.scaffolds[scaffold].members if scaffold else (module,)
            block = self._encode_unit(schema, scaffold, members)[module]
        return block

    def _positions(self, schema: Schema, module: str, key: BlockKey) -> torch.Tensor:
        """Schema positions ``[n]`` of a block's rows (on the device, made once per key; kept for
        the current version of each schema name only)."""
        memo = self._block_positions.setdefault(schema.name, {})
        positions = memo.get(key)
        if positions is None:
            positions = torch.tensor(schema.modules[module].position_ids, dtype=torch.long, device=self.device)
            memo[key] = positions
        return positions

    def resolve(self, prompt: str | ResolvedPrompt) -> ResolvedPrompt:
        """Parse a PML prompt against the added schemas."""
        if isinstance(prompt, ResolvedPrompt):
            return prompt
        return parse_prompt(prompt, self.schemas)

    def generate(self, prompt: str | ResolvedPrompt, *, max_new_tokens: int = 64, mode: str = "cached",
                 temperature: float = 0.0, top_p: float = 1.0, stop: str | list[str] | None = None,
                 seed: int | None = None, recompute: float = 0.0,
                 recompute_policy: str = "first") -> GenerationResult:
        """Answer a PML prompt. See the class docstring for ``mode``.

        ``recompute`` (cached and reference modes): the share of the imported modules' stale
        tokens (``plan.stale_tokens``) computed afresh in the prompt's forward, attending like
        uncached text, their new states replacing the cached ones; ``recompute_policy`` picks
        them: ``"first"`` tokens of each module or highest ``"deviation"`` (``docs/fidelity.md``).
        """
        run = self._run(prompt, max_new_tokens=max_new_tokens, mode=mode, temperature=temperature,
                        top_p=top_p, stop=stop, seed=seed, recompute=recompute, recompute_policy=recompute_policy)
        return _drain(run)

    def stream(self, prompt: str | ResolvedPrompt, *, max_new_tokens: int = 64, mode: str = "cached",
               temperature: float = 0.0, top_p: float = 1.0, stop: str | list[str] | None = None,
               seed: int | None = None, recompute: float = 0.0,
               recompute_policy: str = "first") -> Iterator[str]:
        """Like ``generate`` but yields the answer's text as it is produced."""
        run = self._run(prompt, max_new_tokens=max_new_tokens, mode=mode, temperature=temperature,
                        top_p=top_p, stop=stop, seed=seed, recompute=recompute, recompute_policy=recompute_policy)
        emitted = ""
        try:
            while True:
                text = next(run)
                if len(text) > len(emitted) and not text.endswith("\ufffd"):
                    yield text[len(emitted):]
                    emitted = text
        except StopIteration as done:
            final = done.value.text
            if len(final) > len(emitted):
                yield final[len(emitted):]

    @torch.inference_mode()
    def _run(self, prompt, *, max_new_tokens: int, mode: str, temperature: float, top_p: float, stop, seed,
             recompute: float = 0.0, recompute_policy: str = "first"):
        t0 = time.perf_counter()
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        resolved = self.resolve(prompt)
        check_answerable(resolved, baseline=mode == "baseline")
        limit = self.adapter.max_positions()
        last_pos = max(resolved.position_ids) if mode != "baseline" else len(resolved.token_ids) - 1
        if limit is not None and last_pos + 1 >= limit:
            raise PMLPromptTooLongError(last_pos, limit)
        if mode == "baseline" and recompute:
            raise ValueError("recompute applies to the cached and reference modes, not baseline")
        recomputed = select_recompute(resolved, recompute, recompute_policy,
                                      lambda: self.deviation.for_schema(resolved.schema))
        generator = make_generator(seed)
        if mode == "baseline":
            logits, positions, cached, computed, step = self._prefill_baseline(resolved)
        elif mode == "reference":
            logits, positions, cached, computed, step = self._prefill_reference(resolved, max_new_tokens, recomputed)
        else:
            logits, positions, cached, computed, step = self._prefill_cached(resolved, max_new_tokens, recomputed)
        first_logits = logits[-1].float()
        token = select_token(first_logits, temperature=temperature, top_p=top_p, generator=generator)
        _sync(self.device)
        ttft = time.perf_counter() - t0
        stopper = StopChecker(self.tokenizer, stop, self.eos_ids)
        out_ids = [token]
        next_pos = positions[-1] + 1 if mode == "baseline" else max(positions) + 1
        done, reason = stopper.check(out_ids)
        while not done and len(out_ids) < max_new_tokens:
            if limit is not None and next_pos >= limit:
                reason = "length"
                break
            yield self.tokenizer.decode(out_ids, skip_special_tokens=True)
            logits = step(token, next_pos)
            token = select_token(logits[-1].float(), temperature=temperature, top_p=top_p, generator=generator)
            out_ids.append(token)
            next_pos += 1
            done, reason = stopper.check(out_ids)
        if not done:
            reason = "length"
        _sync(self.device)
        text = stopper.trim(self.tokenizer.decode(out_ids, skip_special_tokens=True))
        return GenerationResult(
            text=text, token_ids=out_ids, prompt_token_ids=list(resolved.token_ids), positions=list(positions),
            ttft_s=ttft, total_s=time.perf_counter() - t0, cached_tokens=cached, computed_tokens=computed,
            first_logits=first_logits.cpu(), mode=mode, finish_reason=reason,
        )

    def _prefill_cached(self, resolved: ResolvedPrompt, max_new_tokens: int, recomputed=frozenset()):
        plan: CachedPlan = plan_cached(resolved, recomputed)
        buf = self.buffer
        buf.ensure_capacity(plan.rows + max_new_tokens)
        self._place_blocks(buf, resolved.schema, [(b.module, b.scaffold) for b in plan.blocks], start_row=0)
        buf.row_bias[:plan.rows] = 0
        if plan.dead_rows:
            buf.row_bias[torch.tensor(plan.dead_rows, device=self.device)] = float("-inf")
        positions = torch.tensor(plan.new_positions, dtype=torch.long, device=self.device)
        ids = torch.tensor([plan.new_tokens], dtype=torch.long, device=self.device)
        if plan.new_rows_contiguous:
            start, rows = plan.new_rows[0], None
            buf.row_pos[start:start + len(plan.new_rows)] = positions
        else:
            start = 0
            rows = torch.tensor(plan.new_rows, dtype=torch.long, device=self.device)
            buf.row_pos[rows] = positions
        for span_start, span_stop in plan.overwritten_spans:
            buf.invalidate_rows(span_start, span_stop)
        self._cache.prepare(rows=rows, start=start, extent=plan.rows)
        logits = self.adapter.forward(ids, positions[None], buf.attention(positions, plan.rows), self._cache)
        step = self._decode_step(plan.rows)
        all_positions = list(resolved.position_ids)
        computed = len(plan.new_tokens)
        return logits, all_positions, plan.cached_tokens, computed, step

    def _prefill_reference(self, resolved: ResolvedPrompt, max_new_tokens: int, recomputed=frozenset()):
        ref = plan_reference(resolved, recomputed)
        buf = self.buffer
        n = len(ref.tokens)
        buf.ensure_capacity(n + max_new_tokens)
        buf.invalidate_all()
        positions = torch.tensor(ref.positions, dtype=torch.long, device=self.device)
        buf.row_pos[:n] = positions
        live = torch.tensor(ref.live, dtype=torch.bool, device=self.device)
        buf.row_bias[:n] = torch.where(live, 0.0, float("-inf")).to(self.dtype)
        bias = torch.zeros(n, n, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~ref.mask.to(self.device), float("-inf"))
        ids = torch.tensor([ref.tokens], dtype=torch.long, device=self.device)
        self._cache.prepare(rows=None, start=0, extent=n)
        logits = self.adapter.forward(ids, positions[None], AttentionSpec(bias, positions, positions), self._cache)
        step = self._decode_step(n)
        return logits, list(resolved.position_ids), 0, n, step

    def _prefill_baseline(self, resolved: ResolvedPrompt):
        ids = torch.tensor([resolved.token_ids], dtype=torch.long, device=self.device)
        n = ids.shape[1]
        positions = torch.arange(n, device=self.device)[None]
        cache = DynamicCache(config=self.model.config)
        logits = self.adapter.forward(ids, positions, None, cache)

        def step(token: int, pos: int) -> torch.Tensor:
            tok = torch.tensor([[token]], dtype=torch.long, device=self.device)
            return self.adapter.forward(tok, torch.tensor([[pos]], device=self.device), None, cache)

        return logits, list(range(n)), 0, n, step

    def _decode_step(self, rows: int):
        """A closure that appends one decoded token at the next row and returns its logits."""
        buf, cache = self.buffer, self._cache
        state = {"row": rows}

        def step(token: int, pos: int) -> torch.Tensor:
            row = state["row"]
            if row >= buf.capacity:
                raise RuntimeError("assembly buffer overflow while decoding")
            buf.invalidate_rows(row, row + 1)
            buf.row_pos[row] = pos
            buf.row_bias[row] = 0
            cache.prepare(rows=None, start=row, extent=row + 1)
            tok = torch.tensor([[token]], dtype=torch.long, device=self.device)
            query_pos = torch.tensor([pos], device=self.device)
            logits = self.adapter.forward(tok, query_pos[None], buf.decode_attention(query_pos, row + 1), cache)
            state["row"] = row + 1
            return logits

        return step


def _drain(run) -> GenerationResult:
    """Run a ``_run`` generator to completion and return its result."""
    while True:
        try:
            next(run)
        except StopIteration as done:
            return done.value


def _local_weight_files(name_or_path: str) -> list[Path]:
    """The weight files ``from_pretrained`` read for ``name_or_path``: a local directory's, or the
    local HF cache snapshot's; empty when they cannot be found (the tensors are hashed instead)."""
    if Path(name_or_path).is_dir():
        return weight_files(name_or_path)
    try:
        from huggingface_hub import snapshot_download

        return weight_files(snapshot_download(name_or_path, local_files_only=True))
    except Exception as exc:  # any failure only means hashing the loaded tensors instead
        log.debug("weight files of %r not found (%s); hashing tensors", name_or_path, exc)
        return []


def _read_source(text_or_path: str | os.PathLike) -> tuple[str | bytes, Path | None]:
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


def _union_siblings(schema: Schema, blocks: list[tuple[str, str]]) -> list[str]:
    """Members of the unions of ``blocks``' modules that are not among them (likely next)."""
    used = {module for module, _ in blocks}
    unions = {schema.modules[m].union for m in used} - {None}
    return [m for u in sorted(unions) for m in schema.unions.get(u, ()) if m not in used]

