"""Token choice and draft verification for running requests.

After each step a request chooses its next token from its own logits (its
:class:`~pckernels.generation.TokenChoice`: sampling parameters, RNG, stop rules) and streams
it to its handle. With ``lookahead``, a greedy request's decode step also forwards a
prompt-lookup draft (:mod:`pckernels.engine.lookahead`) in its next own rows; :meth:`Decoding.verify`
chooses after each forwarded token in turn and keeps the draft while it is what greedy decoding
chose — chosen by the request's own :meth:`TokenChoice.choose`, from its processed logits (min_tokens
mask, logit bias, repetition and other penalties, grammar), so a draft token the request's rules
would not pick is never kept (a repetition penalty moves the argmax). Rejected rows need no rollback: decoded row j always holds position ``first + j``, so a
stale row is after every query until the step reaching that position overwrites it.
"""

from __future__ import annotations

import collections

import torch

from pckernels.engine.lookahead import NgramDrafter
from pckernels.engine.running import Running


class Decoding:
    """Chooses tokens for running requests and verifies their drafts (module docstring).

    ``max_positions``: positions the model takes (``None``: no limit); ``counters``: the
    scheduler's counters (``draft_tokens``, ``draft_accepted``); ``lookahead``: draft tokens a
    greedy request's decode step may verify besides its own (0: none).
    """

    def __init__(self, max_positions: int | None, counters: collections.Counter, lookahead: int = 0) -> None:
        self.max_positions = max_positions
        self.counters = counters
        self.lookahead = lookahead

    @property
    def lookahead(self) -> int:
        """Draft tokens a greedy request's decode step may verify besides its own (read per step)."""
        return self._lookahead

    @lookahead.setter
    def lookahead(self, value: int) -> None:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {value!r}")
        self._lookahead = value

    def choose(self, active: Running, logits: torch.Tensor) -> bool:
        """Pick ``active``'s next token from its ``logits [vocab]`` and stream it; False when that
        ends the request (the caller finishes it), True when it goes on."""
        choice = active.choice
        token = choice.choose(logits, active.next_pos)
        active.handle._emit(token, choice.logprobs[-1] if choice.logprobs else None, final=choice.done)
        if active.choice.done:
            return False
        active.pending = token
        return True

    def drafts(self, active: Running) -> list[int]:
        """Tokens to verify after ``active``'s pending one: a prompt-lookup draft for greedy
        requests, as long as its rows (``max_new_tokens``) and the model's positions leave room."""
        if active.drafter is None:
            active.draft_room = self.lookahead
        room = min(active.draft_room, active.choice.room() - 1)
        if self.max_positions is not None:
            room = min(room, self.max_positions - active.next_pos - 1)
        if room < 1 or not active.choice.greedy:
            return []
        prompt = active.request.prompt_token_ids
        if active.drafter is None:
            active.drafter = NgramDrafter(list(prompt))
        active.drafter.extend(active.token_ids[len(active.drafter.tokens) - len(prompt):])
        return active.drafter.propose(room)

    def verify(self, active: Running, tokens: list[int], logits: torch.Tensor) -> bool:
        """A decode step forwarded ``tokens`` (the pending one, then a draft): choose after each in
        turn (``logits [len(tokens), vocab]``), keeping the draft while it is what was chosen.
        False when the request ended (the caller finishes it)."""
        drafts = tokens[1:]
        accepted = 0
        going = True
        for index in range(len(tokens)):
            active.decoded_rows += 1
            active.next_pos += 1
            if not self.choose(active, logits[index]):
                going = False
                break
            if index == len(drafts) or active.pending != drafts[index]:
                break
            accepted += 1
        if drafts:
            self.counters["draft_tokens"] += len(drafts)
            self.counters["draft_accepted"] += accepted
            if accepted == len(drafts):
                active.draft_room = min(self.lookahead, 2 * active.draft_room)
            elif accepted == 0:
                active.draft_room = max(1, active.draft_room // 2)
        return going
