"""``torch.ops.promptcache.*`` callable after ``import pckernels``, registered on first use.

Registering the ops (:mod:`pckernels.ops._library`) imports Triton and ``torch._dynamo``,
which costs seconds; ``import pckernels`` only installs ``torch.ops.promptcache`` as a
namespace that imports the registrations the first time one of its ops is looked up.
"""

from __future__ import annotations

import importlib

import torch
from torch._ops import _OpNamespace

NAMESPACE = "promptcache"
REGISTRATIONS = "pckernels.ops._library"


class _RegisteringNamespace(_OpNamespace):
    """``torch.ops.promptcache``: registers the ops before the first op lookup."""

    def __getattr__(self, name: str):
        if not name.startswith("__"):
            importlib.import_module(REGISTRATIONS)
        return super().__getattr__(name)


def install() -> None:
    """Make ``torch.ops.promptcache.<op>`` resolve; registers at once if the namespace already exists."""
    existing = torch.ops.__dict__.get(NAMESPACE)
    if existing is None:
        setattr(torch.ops, NAMESPACE, _RegisteringNamespace(NAMESPACE))
        torch.ops._dir.append(NAMESPACE)
    elif not isinstance(existing, _RegisteringNamespace):
        importlib.import_module(REGISTRATIONS)
