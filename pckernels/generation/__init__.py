"""What every way of generating shares: sampling parameters and token selection, stop rules, the
per-request token choice (the one decode loop's brain), streamed text and the result.

A leaf: it imports nothing of promptcache's above :mod:`pckernels.errors`, so the prefix cache,
the engine and the server all build on it without reaching into each other.
"""

from pckernels.generation.choice import TokenChoice, TokenLogprob
from pckernels.generation.result import GenerationResult
from pckernels.generation.sampling import (SAMPLING_OPTIONS, SamplingParams, make_generator, sampling_params,
                                          select_token)
from pckernels.generation.stops import eos_token_ids, first_stop
from pckernels.generation.text import Detokenizer, TextStream

__all__ = ["Detokenizer", "GenerationResult", "SAMPLING_OPTIONS", "SamplingParams", "TextStream", "TokenChoice",
           "TokenLogprob", "eos_token_ids", "first_stop", "make_generator", "sampling_params", "select_token"]
