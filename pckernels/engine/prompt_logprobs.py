"""The prompt's own log-probabilities (``echo`` + ``logprobs`` on completions, evaluation harnesses'
log-likelihoods): one plain causal forward over the whole prompt, no reuse.

Reused prefix blocks were read in other chunks and batches, so their logits are not at hand; a
cold read computes what an evaluation harness expects (a plain Hugging Face forward's
``log_softmax``) to rounding. It runs on the scheduler thread under the model lock, between two
steps (``Scheduler.call``), like encoding.
"""

from __future__ import annotations

import torch

from pckernels.generation import TokenLogprob

MAX_TOP = 20
"""Alternatives per token OpenAI's completions API allows."""


def prompt_logprobs(adapter, ids: list[int], top: int, device) -> list[TokenLogprob]:
    """For ``ids [seq]``: per token its
    log-probability given the tokens before it and the ``top`` best alternatives, best first
    (the first token's logprob is ``None``: nothing precedes it).
    ``adapter``: the engine's :class:`~pckernels.integration.adapters.ModelAdapter` (its plain
    causal path: no promptcache attention, a fresh cache)."""
    if not 0 <= top <= MAX_TOP:
        raise ValueError(f"top must be between 0 and {MAX_TOP}, got {top}")
    if not ids:
        return []
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    positions = torch.arange(len(ids), device=device)[None]
    with torch.inference_mode():
        logits = adapter.forward(tokens, positions, None, None, last_logits_only=False)  # [seq, vocab]
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # [seq - 1, vocab]: predicts ids[1:]
        chosen = logp.gather(1, tokens[0, 1:, None])[:, 0].tolist()
        best = logp.topk(top, dim=-1) if top else None
    out = [TokenLogprob(ids[0], None)]  # type: ignore[arg-type]  (OpenAI's null)
    for k, (token, value) in enumerate(zip(ids[1:], chosen)):
        alternatives = ()
        if best is not None:
            alternatives = tuple(zip(best.indices[k].tolist(), best.values[k].tolist()))
        out.append(TokenLogprob(token, value, alternatives))
    return out
