"""Fixtures of the kernel tests (test_cpu_ops.py, test_cpu_attention.py)."""

import shutil

import pytest
import torch

from llmserve.model.kernels import ops


@pytest.fixture(scope="module")
def ext():
    """The C++ extension; the test is skipped where it cannot be built (the PyTorch fallbacks run there)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or not shutil.which("g++"):
        pytest.skip("no AVX2 or no compiler: the PyTorch fallbacks run instead")
    e = ops.cpu_kernels()
    assert e is not None, "the extension must build where AVX2 and a compiler exist"
    return e
