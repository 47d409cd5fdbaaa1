"""promptcache: modular attention (KV) reuse for LLM prompts."""

from pckernels.errors import PMLError, UnsupportedModelError

__version__ = "0.1.0"
__all__ = ["PMLError", "UnsupportedModelError", "PromptCache", "__version__"]


def __getattr__(name: str):
    if name == "PromptCache":
        from pckernels.engine import PromptCache

        return PromptCache
    raise AttributeError(f"module 'pckernels' has no attribute {name!r}")
