"""``torch.ops.promptcache.*`` callable after ``import pckernels``, registered on first use.

Registering the ops (:mod:`pckernels.ops._library`) imports Triton and ``torch._dynamo``,
which costs seconds; ``import pckernels`` only installs ``torch.ops.promptcache`` as a
namespace that imports the registrations the first time one of its ops is looked up.
"""

from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)

try:
    from torch._ops import _OpNamespace
except ImportError:
    _OpNamespace = None

NAMESPACE = "promptcache"
REGISTRATIONS = "pckernels.ops._library"


if _OpNamespace is not None:
    class _RegisteringNamespace(_OpNamespace):
        """``torch.ops.promptcache``: registers the ops before the first op lookup."""

        def __getattr__(self, name: str):
            if not name.startswith("__"):
                importlib.import_module(REGISTRATIONS)
            return super().__getattr__(name)


def install() -> None:
    """Make ``torch.ops.promptcache.<op>`` resolve; registers at once if the namespace already
    exists, or if this torch lacks the (private) namespace class the lazy path relies on."""
    existing = torch.ops.__dict__.get(NAMESPACE)
    if existing is None and _OpNamespace is not None and isinstance(getattr(torch.ops, "_dir", None), list):
        setattr(torch.ops, NAMESPACE, _RegisteringNamespace(NAMESPACE))
        torch.ops._dir.append(NAMESPACE)
        return
    if existing is None:
        log.debug("registering torch.ops.%s at import: no lazy namespace in this torch", NAMESPACE)
    if existing is None or not isinstance(existing, _RegisteringNamespace if _OpNamespace else ()):
        importlib.import_module(REGISTRATIONS)
