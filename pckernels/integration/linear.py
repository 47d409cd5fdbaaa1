"""Per-instance switch of a model's ``nn.Linear`` layers to :func:`pckernels.ops.linear`.

On CPU in fp32 the BLAS GEMM behind ``F.linear`` is slow for the handful of rows a decode step
multiplies (one row per running request); oneDNN's inner product does the same product
1.5-1.7x faster on SmolLM2 (``perf/``). :func:`apply_fast_linear` changes the class of each
``nn.Linear`` *of one model instance* to a subclass whose ``forward`` calls the op — weights,
``state_dict``, hooks and ``isinstance`` stay as they were, other models in the process are
untouched, and :func:`revert_fast_linear` restores the original classes. The op itself falls
back to ``F.linear`` per call for anything it does not cover (other devices or dtypes, autograd).
"""

from __future__ import annotations

import functools

import torch

from pckernels import ops

_MARK = "_promptcache_linear"


@functools.cache
def _fast_class(cls: type) -> type:
    """A subclass of ``cls`` (an ``nn.Linear`` subclass) whose forward is the promptcache op."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return ops.linear(input, self.weight, self.bias)

    return type(cls.__name__, (cls,), {"forward": forward, _MARK: cls, "__module__": cls.__module__,
                                       "__doc__": cls.__doc__})


def _plain(module: torch.nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is ``nn.Linear.forward`` (not a quantized or LoRA layer)."""
    cls = type(module)
    return (isinstance(module, torch.nn.Linear) and _MARK not in cls.__dict__
            and cls.forward is torch.nn.Linear.forward and "forward" not in module.__dict__)


def apply_fast_linear(model: torch.nn.Module) -> int:
    """Switch the plain ``nn.Linear`` layers of ``model`` to :func:`pckernels.ops.linear`;
    returns how many were switched (0 when the model already was, or has none)."""
    count = 0
    for module in model.modules():
        if _plain(module):
            module.__class__ = _fast_class(type(module))
            count += 1
    return count


def revert_fast_linear(model: torch.nn.Module) -> int:
    """Undo :func:`apply_fast_linear` on ``model``; returns how many layers were restored."""
    count = 0
    for module in model.modules():
        original = type(module).__dict__.get(_MARK)
        if original is not None:
            module.__class__ = original
            count += 1
    return count


def fast_linear_applied(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` runs through :func:`pckernels.ops.linear`."""
    return any(_MARK in type(m).__dict__ for m in model.modules())
