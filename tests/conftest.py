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


@pytest.fixture
def cli_without_loading(monkeypatch, tmp_path):
    """For command-line tests whose settings must be refused before a model loads: loading one fails
    the test; the model cache points into ``tmp_path``."""
    from pckernels.engine import PromptCache
    from pckernels.engine import core as core_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before its settings were checked")

    monkeypatch.setattr(PromptCache, "from_pretrained", no_loading)
    monkeypatch.setattr(core_module, "load_pretrained", no_loading)
    monkeypatch.setenv("PROMPTCACHE_CACHE_DIR", str(tmp_path / "cache"))
