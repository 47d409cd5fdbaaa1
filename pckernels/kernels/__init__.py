"""The kernels of the product path, one package per op: ``gather_concat`` (blocks -> assembly
buffer), ``gather_rotate`` (the same, re-rotating keys to new positions), ``scatter_rows`` (rows
-> buffer). Each holds the argument checks and the torch-native path (``__init__.py``), the
Triton kernel and its launcher (``kernel.py``, imported only when the Triton path first runs)
and a plain-torch reference (``naive.py``). Use them through :mod:`pckernels.ops`; the RoPE
extras are in :mod:`pckernels.extras`.
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
