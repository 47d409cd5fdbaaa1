"""One request's token choices: the one decode loop's brain, whoever runs the forwards.

A :class:`TokenChoice` takes the logits of each step, adjusts them as the request asks
(``min_tokens`` mask, logit bias, repetition, presence and frequency penalties, a grammar's mask
of the tokens it allows: vLLM's order), picks the next
token by the request's :class:`~pckernels.generation.sampling.SamplingParams` (its own seeded
RNG), records its log-probability and the top alternatives when asked (from the adjusted logits,
the ones the choice was made from), and says when the generation ends: an end-of-sequence id, a
stop string, ``max_new_tokens``, or the model's last position. A draft token the grammar forbids
is never chosen, so lookahead rejects it. The engine's scheduler keeps one per running request; the single-caller
:class:`~pckernels.prefix.PrefixCache` keeps one for its own loop. Both build their
:class:`~pckernels.generation.result.GenerationResult` with :meth:`TokenChoice.result`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pckernels.generation.result import GenerationResult
from pckernels.generation.sampling import SamplingParams, make_generator, select_token
from pckernels.generation.text import TextStream


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the ``top`` alternatives ``(token, logprob)``, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenChoice:
    """The tokens one request has chosen and why it stopped (module docstring).

    ``eos_ids``: ids that end the generation; ``max_positions``: positions the model takes
    (``None``: no limit); ``started``: ``time.perf_counter()`` when the request arrived (its
    time to first token counts from there). A ``tokenizer`` of ``None`` decodes no text and
    checks no stop strings. ``prompt_token_ids``: the prompt, which ``repetition_penalty`` counts
    as vLLM does (with the answer so far).
    """

    def __init__(self, params: SamplingParams, tokenizer, eos_ids: set[int], *, max_positions: int | None = None,
                 started: float | None = None, prompt_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.max_positions = max_positions
        self.started = time.perf_counter() if started is None else started
        self.generator = make_generator(params.seed)
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        """Ids that end the answer as EOS (none with ``ignore_eos``)."""
        self.stop_ids = set(params.stop_token_ids)
        self.prompt_token_ids = tuple(prompt_token_ids)
        self._seen: torch.Tensor | None = None
        """Ids of the prompt or the answer so far ``[vocab]`` (bool), for ``repetition_penalty``."""
        self._floor = 0
        """Characters of the answer's text before the ``min_tokens``-th token: a stop string must end after it."""
        self.stop_match: tuple[int, str] | None = None
        """``(index, stop string)`` of the stop string that ended the answer, in the answer's text."""
        self.stopped_by_id = False
        """Whether the answer ended with one of ``stop_token_ids``."""
        self.answer = (TextStream(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens)
                       if tokenizer is not None else None)
        """The answer's text, built as the stream builds it (the same stop cut), fed a token at a
        time: at each choice when the request has stop strings, else when :meth:`text` is asked."""
        self._exact = bool(params.min_tokens or params.include_stop_str_in_output) and bool(params.stop)
        """Stop strings checked on the whole text (``min_tokens`` or ``include_stop_str_in_output``
        change where the cut is), not by :attr:`answer` (which cuts at the first stop string): each
        token then decodes the whole answer, a cost only such requests pay."""
        self.token_ids: list[int] = []
        self.first_logits: torch.Tensor | None = None
        """float32 ``[vocab]`` (CPU): the model's logits before the first token was chosen (before any
        adjustment: what exactness is judged on)."""
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        self._counts: torch.Tensor | None = None
        """Generated tokens per id ``[vocab]`` (float), for the penalties."""
        self.ttft = 0.0
        self.finish_reason: str | None = None
        """``"eos"``, ``"stop"`` or ``"length"`` once the generation has ended, else None."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def room(self) -> int:
        """Tokens this request may still choose (``max_new_tokens`` less those chosen)."""
        return self.params.max_new_tokens - len(self.token_ids)

    def choose(self, logits: torch.Tensor, next_position: int) -> int:
        """Pick the next token from ``logits [vocab]`` and return it; ``next_position`` is its
        position. Sets :attr:`finish_reason` when the generation ends with it — at the model's last
        position at the latest: prompt and answer together never exceed ``max_positions``, so
        the conversation can be sent again."""
        raw = logits.float()
        scores = self._adjust(raw) if self.params.adjusts else raw
        token = select_token(scores, temperature=self.params.temperature, top_p=self.params.top_p,
                             generator=self.generator, top_k=self.params.top_k, min_p=self.params.min_p)
        if not self.token_ids:
            self.first_logits = raw.cpu()
            self.ttft = time.perf_counter() - self.started
        if self.logprobs is not None:
            self.logprobs.append(_logprob(scores, token, self.params.logprobs))
        self.token_ids.append(token)
        if self._counts is not None:
            self._counts[token] += 1
        if self._seen is not None and token < self._seen.shape[0]:
            self._seen[token] = True
        if self.matcher is not None:
            self.matcher.accept(token)
        done, reason = self._stops(token)
        if not done and (len(self.token_ids) >= self.params.max_new_tokens
                         or (self.max_positions is not None and next_position + 1 >= self.max_positions)):
            done, reason = True, "length"
        if done:
            self.finish_reason = reason
        return token

    def _stops(self, token: int) -> tuple[bool, str]:
        """``(done, reason)`` after choosing ``token``: nothing ends the answer before ``min_tokens``
        (vLLM); then an EOS id (``"eos"``), a stop id or a stop string ending in the text after
        the ``min_tokens``-th token's predecessors (``"stop"``)."""
        params, count = self.params, len(self.token_ids)
        if count < params.min_tokens:
            return False, ""
        if token in self.eos_ids:
            return True, "eos"
        if token in self.stop_ids:
            self.stopped_by_id = True
            return True, "stop"
        if self.answer is None or not self.answer.stops:
            return False, ""
        if not self._exact:
            self.answer.push((token,))
            return (True, "stop") if self.answer.stopped else (False, "")
        if params.min_tokens and count == params.min_tokens:
            self._floor = len(self._decode(self.token_ids[:-1]))
        match = _first_stop(self._decode(self.token_ids), self.answer.stops, self._floor)
        if match is not None:
            self.stop_match = match
            return True, "stop"
        return False, ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _adjust(self, raw: torch.Tensor) -> torch.Tensor:
        """``raw [vocab]`` with the min_tokens mask, logit bias, penalties and grammar mask applied
        (a new tensor), in vLLM's order."""
        params = self.params
        scores = raw.clone()
        vocab = scores.shape[0]
        if len(self.token_ids) < params.min_tokens:
            masked = [t for t in self.eos_ids | self.stop_ids if t < vocab]
            if masked:
                scores[torch.tensor(masked, dtype=torch.long, device=scores.device)] = float("-inf")
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=scores.device)
            keep = ids < scores.shape[0]
            values = torch.tensor([b for _, b in params.logit_bias], dtype=scores.dtype, device=scores.device)
            scores.index_add_(0, ids[keep], values[keep])
        if params.repetition_penalty != 1.0:
            if self._seen is None:
                self._seen = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
                ids = [t for t in (*self.prompt_token_ids, *self.token_ids) if 0 <= t < vocab]
                if ids:
                    self._seen[torch.tensor(ids, dtype=torch.long, device=scores.device)] = True
            penalty = params.repetition_penalty
            scores = torch.where(self._seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
        if params.presence_penalty or params.frequency_penalty:
            if self._counts is None:
                self._counts = torch.zeros_like(scores)
            scores -= params.frequency_penalty * self._counts + params.presence_penalty * (self._counts > 0)
        if self.matcher is not None:
            self.matcher.mask_(scores)
        return scores

    def text(self) -> str:
        """The answer's text, cut at the first stop string (``""`` without a tokenizer)."""
        if self.answer is None:
            return ""
        params = self.params
        ids = self.token_ids
        if (self.stopped_by_id or self.finish_reason == "eos") and not params.include_stop_str_in_output:
            ids = ids[:-1]  # as vLLM: the stop id's (or EOS's) text is not the answer's
        if not self._exact:
            answer = self.answer
            if not answer.finished:
                answer.push(ids[len(answer.detok.ids):])
                answer.finish()
            return answer.text
        text = self._decode(ids)
        if self.stop_match is not None:
            at, stop = self.stop_match
            return text[:at + len(stop)] if params.include_stop_str_in_output else text[:at]
        return text

    def result(self, prompt_token_ids: list[int], positions: list[int], *, cached_tokens: int,
               computed_tokens: int, mode: str) -> GenerationResult:
        """The finished generation as a :class:`GenerationResult`."""
        return GenerationResult(
            text=self.text(), token_ids=self.token_ids, prompt_token_ids=list(prompt_token_ids),
            positions=list(positions), ttft_s=self.ttft, total_s=time.perf_counter() - self.started,
            cached_tokens=cached_tokens, computed_tokens=computed_tokens, first_logits=self.first_logits,
            mode=mode, finish_reason=self.finish_reason or "length",
            logprobs=list(self.logprobs) if self.logprobs is not None else None)


def _first_stop(text: str, stops: list[str], floor: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after character ``floor``: ``(index, stop)``."""
    best = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop, max(0, floor - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def _logprob(scores: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under ``scores [vocab]`` and the ``top`` best alternatives."""
    logprobs = torch.log_softmax(scores, dim=-1)
    best = ()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[0]))
        best = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), best)
