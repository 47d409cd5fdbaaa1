"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so that on a
machine without CUDA the Triton kernels themselves run in the interpreter (lane 2).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))
