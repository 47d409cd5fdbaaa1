"""The engine: encode schema modules once, assemble per prompt, generate."""

from pckernels.engine.core import PromptCache
from pckernels.generation.result import GenerationResult

__all__ = ["PromptCache", "GenerationResult"]
