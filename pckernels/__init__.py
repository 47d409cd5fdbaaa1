"""promptcache: modular attention (KV) reuse for LLM prompts.

Importing the package makes ``torch.ops.promptcache.*`` callable (they register on first use).
"""

from pckernels import _torch_ops
from pckernels.errors import PMLError, PromptTooLongError, UnsupportedModelError

_torch_ops.install()

__version__ = "0.1.0"
__all__ = ["PMLError", "PromptTooLongError", "UnsupportedModelError", "PromptCache", "__version__"]


def __getattr__(name: str):
    if name == "PromptCache":
        from pckernels.engine import PromptCache

        return PromptCache
    raise AttributeError(f"module 'pckernels' has no attribute {name!r}")
