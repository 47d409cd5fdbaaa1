"""Exact automatic prefix caching for any prompt, including hybrid attention + recurrent models.

Every prefill — with or without reuse — reads the prompt in chunks of ``chunk_size`` tokens that
start at position 0 and at every multiple of ``chunk_size``. A prefill that resumes from stored
states therefore starts at a chunk boundary and performs, chunk for chunk, the same operations
on the same inputs as a prefill from scratch: same token ids, same position ids, same tensor
shapes (so the same attention mask and kernel), bit-identical restored keys/values and
recurrent states. Its first-token logits are bitwise equal to the uncached ones, and so is every
decode step after it, because both modes decode one token at a time on equal caches.

Only states produced while *reading a prompt* are stored: full blocks, plus a prompt-end entry
(the partial last block, the states at the prompt's end and its final logits) that lets an
exact repeat skip the forward entirely. States produced while generating an answer are never
reused, since a later prompt containing that answer would read it in prefill chunks, a different
computation. See ``docs/prefix.md``.
"""

from __future__ import annotations

import logging
import threading
from array import array

import torch

from pckernels.errors import PromptTooLongError, UnsupportedModelError
from pckernels.generation import GenerationResult, SamplingParams, TokenChoice, eos_token_ids
from pckernels.integration.identity import model_fingerprint
from pckernels.integration.adapters import ModelAdapter, adapter_for
from pckernels.prefix.base import BasePrefixCache, Prefill, PrefixMatch, PromptRows
from pckernels.prefix.blocks import BlockStore, CachedEntry, block_keys, common_prefix, prompt_end_key
from pckernels.prefix.check import self_check
from pckernels.prefix.prompts import Prompt, encode_prompt
from pckernels.prefix.reading import Reading
from pckernels.prefix.spill import BlockSpill
from pckernels.prefix.states import CacheStates
from pckernels.store import TieredStore
from pckernels.store.events import PREFIX_MEDIUM, BlockInfo, BlockLedger, prefix_block_info

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 256
"""Tokens per block. On the embedded SmolLM2 (fp32, 2 CPU threads) a 2K-token prefill read in
256-token chunks costs about 17% more than one pass (64: +83%, 128: +39%, 512: +11%), while
256 keeps the reuse granularity fine enough that a middle edit recomputes at most 255 extra
tokens."""

DEFAULT_BUDGET_BYTES = 1 << 30

RESUME = ("block", "token")
"""Where a prefill may resume (``PrefixCache(resume=...)``)."""

def _max_positions(model) -> int | None:
    """The positions ``model`` takes: its adapter's ``max_positions()`` (the base adapter's for
    families promptcache has no adapter for, such as recurrent models)."""
    try:
        adapter = adapter_for(model, attach=False)
    except UnsupportedModelError:
        adapter = ModelAdapter(model, attach=False)
    return adapter.max_positions()


class PrefixCache(BasePrefixCache):
    """Automatic, exact prefix reuse for ``model`` (a transformers causal LM in eval mode).

    ``block_size``: tokens per hash-chained block. ``chunk_size``: tokens per prefill forward,
    a multiple of ``block_size`` (default: equal); reuse resumes only at chunk boundaries.
    ``budget_bytes``: bytes of stored states kept before least-recently-used blocks are evicted.
    ``strict``: raise :class:`~pckernels.errors.UnsupportedModelError` at construction when the
    model's states cannot be restored exactly; otherwise reuse is refused with a logged warning
    and every call computes the full prompt in one pass (results report ``mode="uncached"``).

    ``spill``: a :class:`~pckernels.store.TieredStore` that receives full blocks evicted for the
    budget (as ``[L, 2, H, block_size, D]`` blocks) and gives them back when a later prompt needs
    them; with a disk tier they survive a restart. ``spill_model_id``: the model's identity in
    the store's keys (``model_fingerprint``; computed when omitted). Prompt ends are never
    spilled; a block of a model with recurrent layers goes with its recurrent snapshot, packed
    (``pckernels.prefix.packing``). ``clear`` drops without spilling.

    ``max_positions``: the positions the model takes (``None``: no limit); prompts must leave one
    to generate at.

    ``resume``: ``"block"`` (default) resumes a prefill only at a chunk boundary, so reuse on is
    bitwise equal to reuse off; ``"token"`` (attention-only models) resumes after any stored block,
    and also takes the leading tokens of a stored entry that the prompt shares beyond its last
    full matching block, then reads on from the first new token in ``chunk_size`` pieces — equal
    to reuse off to rounding (its chunks are cut elsewhere than a cold read's). What it computes
    is stored as well (as vLLM's and SGLang's prefix caches do), so a block's bits are those of
    whichever read stored it first: every hit stays equal to reuse off to rounding.

    ``events``: a KV-event :class:`~pckernels.store.events.BlockLedger` told which full blocks this
    cache's memory gains and loses (medium ``GPU``; ``docs/kv-events.md``); ``None``: off.

    Construction runs a small self-check on random tokens: a chunked prefill must agree with a
    one-pass prefill (the model really continues from its cached state), and a prefill resumed
    from restored states, plus a decode step, must be bitwise equal to the uninterrupted one.
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 chunk_size: int | None = None, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 strict: bool = False, spill: TieredStore | None = None,
                 spill_model_id: str | None = None, resume: str = "block",
                 events: BlockLedger | None = None) -> None:
        chunk_size = block_size if chunk_size is None else chunk_size
        if block_size < 1 or chunk_size < block_size or chunk_size % block_size:
            raise ValueError(f"need block_size >= 1 and chunk_size a multiple of it, got {block_size=}, {chunk_size=}")
        if resume not in RESUME:
            raise ValueError(f"resume must be one of {', '.join(RESUME)}, got {resume!r}")
        self.resume = resume
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.device = next(model.parameters()).device
        self.max_positions = _max_positions(model)
        self.states = self._make_states()
        self.spill: BlockSpill | None = None
        self._store = BlockStore(budget_bytes, on_evict=self._spill_evicted)
        self._events = None
        self._lock = threading.Lock()
        self._root = f"promptcache-prefix/{block_size}/{chunk_size}{self._root_tag()}".encode()
        self._counters = {"queries": 0, "hits": 0, "full_hits": 0, "hit_tokens": 0, "computed_tokens": 0,
                          "partial_tokens": 0}
        self.refusal = self_check(self)
        if self.refusal is not None:
            message = f"exact prefix reuse is not available for {type(model).__name__}: {self.refusal}"
            if strict:
                raise UnsupportedModelError(message)
            log.warning("%s; prompts will be computed in full", message)
        if resume == "token" and self.states.has_recurrent_layers:
            raise ValueError("resume='token' needs an attention-only model: recurrent states exist only at the "
                             "chunk boundaries they were saved at")
        self.spill = self._make_spill(spill, spill_model_id)
        if events is not None:
            self.attach_events(events)

    def attach_events(self, ledger: BlockLedger) -> None:
        """Tell ``ledger`` which full blocks this cache holds now and from now on (medium ``GPU``)."""
        with self._lock:
            self._events = ledger.place("prefix", PREFIX_MEDIUM)
            self._store.listener = self._entry_changed
            for entry in self._store.entries():
                self._entry_changed(entry, True)

    def _entry_changed(self, entry: CachedEntry, stored: bool) -> None:
        """The store's listener: full blocks go to the KV-event ledger (prompt ends are not blocks)."""
        if entry.final_logits is not None or entry.num_tokens != self.block_size:
            return
        if stored:
            self._events.hold(entry.key, self._block_info(entry))
        else:
            self._events.drop(entry.key)

    def _block_info(self, entry: CachedEntry) -> BlockInfo | None:
        """How KV events name a full block (made once, chained on its parent's), ``None`` when its
        tokens are not known."""
        if entry.info is None and entry.token_ids is not None:
            parent = None
            if entry.parent is not None:
                parent_info = self._block_info(entry.parent)
                if parent_info is None:
                    return None
                parent = parent_info.hash
            entry.info = self._new_info(parent, entry.token_ids, entry.anchor, entry.end)
        return entry.info

    def _new_info(self, parent: int | None, token_ids, anchor: bytes | None, end: int) -> BlockInfo:
        salt = anchor.partition(b"/salt/")[2] if parent is None and anchor else b""
        recurrent = self.states.has_recurrent_layers and end % self.chunk_size == 0
        return prefix_block_info(parent, token_ids, salt, recurrent)

    def _make_states(self):
        """How working caches are made and states copied (subclasses keep them elsewhere)."""
        return CacheStates(self.model)

    def _root_tag(self) -> str:
        """Appended to the root of every block chain: computations that give different bits
        (another forward, another cache layout) must never share a block."""
        return ""

    def _spill_numerics(self) -> str:
        """The device kind, or what else decides a block's bits, in spilled blocks' store keys."""
        return self.device.type

    def _make_spill(self, store: TieredStore | None, model_id: str | None) -> BlockSpill | None:
        """The spill target for ``store``, or ``None`` when there is none or this model cannot use one."""
        if store is None or self.refusal is not None:
            return None
        dtype = next(self.model.parameters()).dtype
        if model_id is None:
            model_id = model_fingerprint(self.model, dtype)
        name = getattr(self.model.config, "_name_or_path", "") or self.model.config.model_type
        return BlockSpill(store, model_id=model_id, device=self.device, kv_dtype=dtype,
                          num_layers=len(self.states.kinds), model_name=name, numerics=self._spill_numerics(),
                          kinds=self.states.kinds)

    def _spill_evicted(self, entry: CachedEntry) -> None:
        """Eviction hook: write a full block to the spill store (prompt ends are dropped)."""
        if self.spill is not None and entry.final_logits is None:
            self.spill.put(entry)

    @property
    def reuse_supported(self) -> bool:
        """Whether reuse is active (``False`` when the self-check refused this model)."""
        return self.refusal is None

    def complete(self, prompt: Prompt, *, max_new_tokens: int = 64, reuse: bool = True,
                 temperature: float = 0.0, top_p: float = 1.0, stop: str | list[str] | None = None,
                 seed: int | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt`` (text, token ids or chat messages).

        With ``reuse`` the longest stored prefix is restored and the rest computed; without it
        the prompt is computed in the same chunks and nothing is looked up or stored. Raises
        :class:`~pckernels.errors.PromptTooLongError` when the prompt fills ``max_positions``;
        generation stops (``finish_reason="length"``) at the last position.
        """
        choice = TokenChoice(SamplingParams.of(max_new_tokens, temperature, top_p, stop, seed), self.tokenizer,
                             eos_token_ids(self.model, self.tokenizer) if self.tokenizer is not None else set(),
                             max_positions=self.max_positions)
        prompt_ids = encode_prompt(self.tokenizer, prompt)
        prefill = self.prefill(prompt_ids, reuse=reuse)
        with torch.no_grad():
            self._decode(prefill.cache, prefill.logits, len(prompt_ids), choice)
        return choice.result(prompt_ids, list(range(len(prompt_ids))), cached_tokens=prefill.cached_tokens,
                             computed_tokens=len(prompt_ids) - prefill.cached_tokens, mode=prefill.mode)

    def check_length(self, num_tokens: int) -> None:
        """Raise :class:`~pckernels.errors.PromptTooLongError` when ``num_tokens`` prompt tokens leave
        no position to generate at."""
        if self.max_positions is not None and num_tokens >= self.max_positions:
            raise PromptTooLongError(num_tokens - 1, self.max_positions)

    def prefill(self, prompt_ids: list[int], *, reuse: bool = True, salt: str = "",
                into: PromptRows | None = None) -> Prefill:
        """Read ``prompt_ids`` exactly as :meth:`complete` does (restoring the longest stored prefix
        when ``reuse``) and return the states and last logits, for a caller that decodes itself.
        ``salt`` roots the block chain in a namespace of its own: the same tokens under another salt
        match nothing. ``into``: where the prompt's states go, for caches that read into given rows
        (:class:`~pckernels.prefix.base.PromptRows`; this class's HF caches keep their own and
        refuse them). Not thread-safe with other forwards of the model."""
        return super().prefill(prompt_ids, reuse=reuse, salt=salt, into=into)

    def begin(self, prompt_ids: list[int], *, reuse: bool = True, salt: str = "",
              into: PromptRows | None = None) -> Reading:
        """Start reading ``prompt_ids`` as :meth:`prefill` does (the stored prefix restored at once),
        for a caller that reads the rest a few chunks at a time (:class:`~pckernels.prefix.reading.Reading`:
        the engine's scheduler); close the reading when done or abandoned."""
        return Reading(self, prompt_ids, reuse=reuse, salt=salt, into=into)

    def match(self, prompt_ids: list[int], salt: str = "") -> PrefixMatch:
        """The longest stored prefix of ``prompt_ids`` a prefill can resume after, reading blocks
        back from the spill store where memory lacks them, or the whole prompt when its end is
        stored; the match's deepest entry is held (``PrefixMatch.held``: release it). With
        ``resume="token"`` it goes on into the stored entry that shares most of the prompt's next
        tokens (``PrefixMatch.partial``, held too)."""
        n = len(prompt_ids)
        root = self._chain_root(salt)
        keys = block_keys(prompt_ids, self.block_size, root)
        found = PrefixMatch(n, keys, prompt_end_key(keys[-1] if keys else root, prompt_ids[len(keys) * self.block_size:]),
                            root)
        with self._lock:
            found.end = self._store.get(found.end_key)
            restored: list[CachedEntry] = []
            if found.end is not None:
                found.chain = found.end.chain()
            else:
                matched = self._store.longest_chain(keys)
                restored = self._restore_spilled(keys, matched, n, root, prompt_ids)
                if self.resume == "token":
                    found.chain = (matched + restored)[:(n - 1) // self.block_size]
                    self._extend_partial(found, prompt_ids)
                else:
                    found.chain = self._resumable(matched + restored, n)
            if found.chain:
                found.held = found.chain[-1]
                self._store.acquire(found.held)
            if found.partial is not None:
                self._store.acquire(found.partial)
            if restored:
                self._store.release(restored[-1])
        return found

    def _extend_partial(self, found: PrefixMatch, prompt_ids: list[int]) -> None:
        """Token-granular resumption: after ``found.chain``, the stored entry sharing most of the
        prompt's next tokens, leaving at least one token to compute. Call with the lock held."""
        start = found.chain[-1].end if found.chain else 0
        anchor = found.chain[-1].key if found.chain else found.root
        rest = prompt_ids[start:len(prompt_ids) - 1]
        best, count = None, 0
        for entry in self._store.children(anchor):
            if entry.token_ids is not None:
                shared = common_prefix(entry.token_ids, rest)
                if shared > count:
                    best, count = entry, shared
        found.partial, found.partial_tokens = best, count

    def insert(self, entry: CachedEntry) -> CachedEntry:
        """Store ``entry`` (its parent stored) and return the stored entry, held for the caller."""
        with self._lock:
            return self._store.insert(entry)

    def acquire(self, entry: CachedEntry | None) -> None:
        with self._lock:
            self._store.acquire(entry)

    def release(self, entry: CachedEntry | None) -> None:
        with self._lock:
            self._store.release(entry)

    def evict(self, nbytes: int) -> int:
        """Evict least recently used unheld entries (full blocks go to the spill store, as on the
        budget) until ``nbytes`` bytes are freed or none is evictable; returns the bytes freed."""
        with self._lock:
            before = self._store.bytes
            self._store.evict_to(max(0, before - nbytes))
            return before - self._store.bytes

    def stats(self) -> dict:
        """Counters since construction plus the store's current size.

        ``queries``: completions with reuse on; ``hits``: those that reused at least one token;
        ``full_hits``: exact repeats served without a forward; ``hit_tokens``: prompt tokens
        restored rather than computed; ``computed_tokens``: prompt tokens computed by those
        queries; ``evictions`` / ``evicted_tokens``: entries and tokens dropped for the budget;
        ``bytes`` / ``entries``: what the store holds now. ``spill``: whether evicted blocks go to
        a spill store; ``spilled_blocks``: blocks written there; ``restored_blocks`` /
        ``restored_tokens``: blocks and tokens read back from it into memory (counted in
        ``hit_tokens`` as far as a prefill resumed after them).
        """
        with self._lock:
            spill = self.spill
            return {
                **self._counters,
                "spill": spill is not None,
                "spilled_blocks": spill.spilled_blocks if spill else 0,
                "restored_blocks": spill.restored_blocks if spill else 0,
                "restored_tokens": spill.restored_tokens if spill else 0,
                "evictions": self._store.evictions,
                "evicted_tokens": self._store.evicted_tokens,
                "bytes": self._store.bytes,
                "entries": len(self._store),
                "budget_bytes": self._store.budget_bytes,
                "block_size": self.block_size,
                "chunk_size": self.chunk_size,
                "reuse_supported": self.refusal is None,
                "refusal": self.refusal,
            }

    def clear(self) -> None:
        """Drop all stored blocks that no running request holds (without spilling them; blocks
        spilled earlier stay in the spill store)."""
        with self._lock:
            if self._events is None:
                self._store.clear()
            else:
                with self._events.ledger.clearing():
                    self._store.clear()

    def chain_keys(self, prompt_ids: list[int], salt: str = "") -> list[bytes]:
        """The names of the full blocks of ``prompt_ids`` under ``salt`` (see :func:`block_keys`)."""
        return block_keys(prompt_ids, self.block_size, self._chain_root(salt))

    def _chain_root(self, salt: str) -> bytes:
        return self._root + b"/salt/" + salt.encode() if salt else self._root

    def count(self, num_tokens: int, cached_tokens: int, *, whole: bool, partial: int = 0) -> None:
        """Count a finished reading with reuse: ``cached_tokens`` of ``num_tokens`` restored
        (``partial`` of them from within an entry, token-granular), ``whole``: the prompt end was
        stored (no forward)."""
        with self._lock:
            self._counters["partial_tokens"] += partial
            self._counters["queries"] += 1
            self._counters["hits"] += cached_tokens > 0
            self._counters["full_hits"] += whole
            self._counters["hit_tokens"] += cached_tokens
            self._counters["computed_tokens"] += num_tokens - cached_tokens

    def _restore_spilled(self, keys: list[bytes], matched: list[CachedEntry], num_tokens: int,
                         root: bytes, prompt_ids: list[int]) -> list[CachedEntry]:
        """Continue ``matched`` (the in-memory chain of ``keys``) with blocks from the spill store.

        Only blocks a prefill can resume after are read: those ending at or before the last chunk
        boundary short of ``num_tokens`` (any block short of it with token resumption). Each is
        inserted into the memory store; the deepest one
        is returned acquired (the caller releases it), its ancestors held through their children.
        Call with the lock held.
        """
        step = self.block_size if self.resume == "token" else self.chunk_size
        usable_blocks = (num_tokens - 1) // step * step // self.block_size
        restored: list[CachedEntry] = []
        if self.spill is None:
            return restored
        parent = matched[-1] if matched else None
        for index in range(len(matched), usable_blocks):
            start = index * self.block_size
            info = None
            if self._events is not None:
                tokens = prompt_ids[start:start + self.block_size]
                parent_info = self._block_info(parent) if parent is not None else None
                if parent is None or parent_info is not None:
                    info = self._new_info(parent_info.hash if parent_info else None, tokens,
                                          root if parent is None else None, start + self.block_size)
            entry = self.spill.get(keys[index], parent, start, self.block_size, info)
            if entry is None:
                break
            entry.anchor = parent.key if parent is not None else root
            entry = self._store.insert(entry)
            if restored:
                self._store.release(restored[-1])
            restored.append(entry)
            parent = entry
        return restored

    def _resumable(self, matched: list[CachedEntry], num_tokens: int) -> list[CachedEntry]:
        """The longest prefix of ``matched`` a prefill can resume after: it must end on a chunk
        boundary, carry a recurrent snapshot when the model needs one, and leave at least one
        prompt token to compute (the final logits are only stored with prompt ends)."""
        usable = len(matched)
        while usable:
            last = matched[usable - 1]
            if (last.end % self.chunk_size == 0 and last.end < num_tokens
                    and (last.states is not None or not self.states.has_recurrent_layers)):
                break
            usable -= 1
        return matched[:usable]

    def store_blocks(self, found: PrefixMatch, prompt_ids: list[int], cache, chunk_start: int, chunk_end: int) -> None:
        """After a chunk ``[chunk_start, chunk_end)`` of ``prompt_ids`` was read into ``cache``: store each full block
        it completed (with the recurrent snapshot where a block ends a chunk); ``found.held``
        follows the deepest stored entry of the prompt."""
        block = self.block_size
        recurrent = self.states.has_recurrent_layers
        # a token-granular resume starts mid-block: its first block's head was restored, not read
        for block_start in range(chunk_start // block * block, chunk_end - block + 1, block):
            block_end = block_start + block
            at_boundary = recurrent and block_end % self.chunk_size == 0
            entry = CachedEntry(
                key=found.keys[block_start // block], parent=found.held, start=block_start, num_tokens=block,
                kv=self.states.kv_slice(cache, block_start, block_end),
                states=self.states.recurrent_snapshot(cache) if at_boundary else None,
                token_ids=array("q", prompt_ids[block_start:block_end]),
                anchor=found.held.key if found.held is not None else found.root,
            )
            self._insert_and_hold(found, entry)
            if self.spill is not None and self.spill.shared:
                self.spill.publish(entry)

    def store_end(self, found: PrefixMatch, prompt_ids: list[int], cache, logits: torch.Tensor) -> None:
        """Store the prompt end (its partial last block, states and last ``logits [vocab]``) once
        the whole of ``prompt_ids`` is read into ``cache``."""
        full_end = len(found.keys) * self.block_size
        num_tokens = len(prompt_ids)
        self._insert_and_hold(found, CachedEntry(
            key=found.end_key, parent=found.held, start=full_end, num_tokens=num_tokens - full_end,
            kv=self.states.kv_slice(cache, full_end, num_tokens),
            states=self.states.recurrent_snapshot(cache) if self.states.has_recurrent_layers else None,
            final_logits=logits.clone(), token_ids=array("q", prompt_ids[full_end:]),
            anchor=found.held.key if found.held is not None else found.root,
        ))

    def _insert_and_hold(self, found: PrefixMatch, entry: CachedEntry) -> None:
        """Store ``entry`` (held on insertion) and drop this reader's hold on its parent."""
        with self._lock:
            stored = self._store.insert(entry)
            if stored is not entry and self.resume == "token" and found.foreign is None:
                found.foreign = entry.start
            previous, found.held = found.held, stored
            self._store.release(previous)

    def run_chunks(self, ids: torch.Tensor, cache, start: int, chunk: int, on_chunk=None) -> torch.Tensor:
        """Forward ``ids [1, seq]`` from ``start`` (a multiple of ``chunk``) in ``chunk``-token pieces.

        ``on_chunk(chunk_start, chunk_end)`` runs after each piece. Returns the logits ``[vocab]``
        of the last token.
        """
        logits = None
        for chunk_start in range(start, ids.shape[1], chunk):
            chunk_end = min(chunk_start + chunk, ids.shape[1])
            logits = self.forward_chunk(cache, ids[:, chunk_start:chunk_end], chunk_start)
            if on_chunk is not None:
                on_chunk(chunk_start, chunk_end)
        return logits

    def forward_chunk(self, cache, input_ids: torch.Tensor, first_position: int) -> torch.Tensor:
        """One forward of ``input_ids [1, q]`` at positions ``first_position...``; logits ``[vocab]``."""
        positions = torch.arange(first_position, first_position + input_ids.shape[1], device=self.device)
        out = self.model(input_ids=input_ids, position_ids=positions[None], use_cache=True, logits_to_keep=1,
                         **{self.states.cache_argument: cache})
        return out.logits[0, -1]

    def _decode(self, cache, logits: torch.Tensor, position: int, choice: TokenChoice) -> None:
        """Choose after the prompt's ``logits [vocab]``, then decode one token per forward from
        ``position`` (the prompt's length) until ``choice`` ends; the same in both modes."""
        while True:
            token = choice.choose(logits, position)
            if choice.done:
                return
            logits = self.forward_chunk(cache, torch.tensor([[token]], dtype=torch.long, device=self.device), position)
            position += 1
