"""Exact automatic prefix caching: reuse the unchanged start of any prompt, bit for bit.

``PrefixCache(model, tokenizer).complete(prompt)`` restores the longest stored prefix of the
prompt's hash-chained token blocks and computes the rest, in the same fixed chunks as a
prefill without reuse, so outputs are bitwise identical. See ``docs/prefix.md``.
"""

from pckernels.prefix.base import BasePrefixCache, Prefill, PrefixMatch
from pckernels.prefix.cache import DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET_BYTES, PrefixCache
from pckernels.prefix.prompts import encode_prompt
from pckernels.prefix.states import UnsupportedCacheError

__all__ = ["BasePrefixCache", "DEFAULT_BLOCK_SIZE", "DEFAULT_BUDGET_BYTES", "Prefill", "PrefixCache", "PrefixMatch",
           "UnsupportedCacheError", "encode_prompt"]
