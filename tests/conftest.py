"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so that on a
machine without CUDA the Triton kernels themselves run in the interpreter (lane 2).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for the module using it (``pytestmark = pytest.mark.usefixtures(...)``):
    tiny models gain nothing from a second, which stalls badly when the cores are busy, and blocks
    one process encodes then round exactly as another's own encode."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
