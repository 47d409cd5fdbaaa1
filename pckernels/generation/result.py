"""What a generation returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class GenerationResult:
    """One generation.

    ``positions``: position ids of the prompt tokens (``prompt_token_ids``) as the model saw them.
    ``ttft_s``: seconds from receiving the prompt to the first token chosen (parse, lookup,
    assembly, forward, sampling; synchronised on GPU). ``first_logits``: float32 ``[vocab]``
    logits the model gave before the first token (before any logit bias, penalty or grammar).
    ``logprobs``: per chosen token, its log-probability and the top alternatives, when asked
    (``SamplingParams.logprobs``; :class:`~pckernels.generation.choice.TokenLogprob`).
    """

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    positions: list[int]
    ttft_s: float
    total_s: float
    cached_tokens: int
    computed_tokens: int
    first_logits: torch.Tensor = field(repr=False)
    mode: str = "cached"
    finish_reason: str = "length"
    logprobs: list | None = None

    def to_dict(self, *, logits: bool = False) -> dict:
        """JSON-ready fields (``first_logits`` only when ``logits``)."""
        out = asdict(self)
        out.pop("first_logits")
        if logits:
            out["first_logits"] = self.first_logits.tolist()
        return out
