"""Triton kernels (with torch-native paths and plain-torch references) for KV assembly and RoPE.

Modules: ``gather_concat`` (blocks -> assembly buffer), ``slot_scatter`` (rows -> buffer),
``rope`` (RoPE at positions, HF cos/sin, re-rotation), ``reference`` (obvious loops for tests).
Use them through :mod:`pckernels.ops`.
"""

from pckernels.kernels._common import (
    BACKEND_ENV,
    HAS_TRITON,
    INTERPRET,
    launch_counts,
    reset_launch_counts,
    triton_runnable,
)

__all__ = ["BACKEND_ENV", "HAS_TRITON", "INTERPRET", "launch_counts", "reset_launch_counts", "triton_runnable"]
