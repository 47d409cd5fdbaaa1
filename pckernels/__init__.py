"""promptcache: modular attention (KV) reuse for LLM prompts.

Importing the package registers every ``torch.ops.promptcache.*`` op (schemas and
implementations, with ``torch.library.custom_op``: milliseconds; Triton is imported only when a
Triton kernel first runs).

It also sets ``MKL_DISABLE_FAST_MM=1`` unless the environment says otherwise (before torch loads
MKL, when it is imported first): MKL's own allocator keeps per-thread buffers, and a process
forked after a thread used MKL can hang in it the first time a thread of the child multiplies
(seen with the engine's scheduler thread and ``multiprocessing`` fork). Malloc costs nothing
measurable for the engine's matmuls.
"""

import os

os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

from pckernels import extras, ops  # noqa: E402, F401  (after the environment is set; registers the ops)
from pckernels.errors import PMLError, PromptTooLongError, UnsupportedModelError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["PMLError", "PromptTooLongError", "UnsupportedModelError", "PromptCache", "__version__"]


def __getattr__(name: str):
    if name == "PromptCache":
        from pckernels.engine import PromptCache

        return PromptCache
    raise AttributeError(f"module 'pckernels' has no attribute {name!r}")
