"""The fused decode stack's projection kinds: Python's ProjectionKind (llmserve/model/kernels/kinds.py) and the C++ enum
(llmserve/csrc/projection_kinds.h) are one table; every layer's kernel_args names one of them."""

from __future__ import annotations

import ast
import pathlib
import shutil

import pytest
import torch

from llmserve.model.kernels import ops
from llmserve.model.kernels.kinds import PACKED_PART, ProjectionKind

MODEL = pathlib.Path(ops.__file__).parent


def test_python_kinds_equal_the_extension_s():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or not shutil.which("g++"):
        pytest.skip("no AVX2 or no compiler: no extension to compare with")
    ext = ops.cpu_kernels()
    assert ext is not None
    assert ext.projection_kinds() == {k.name: k.value for k in ProjectionKind}
    assert ext.packed_part == PACKED_PART


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_kernel_modules_form_no_cycle():
    """cpu_ext.py (the extension's loader) and kinds.py are leaves; gguf_kernels.py loads the extension through
    cpu_ext and never imports ops.py, which imports it."""
    for leaf in ("cpu_ext.py", "kinds.py"):
        assert not {n for n in _imports(MODEL / leaf) if n.startswith("llmserve.model")}, leaf
    assert "llmserve.model.kernels.ops" not in _imports(MODEL / "gguf_kernels.py")
