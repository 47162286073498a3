"""llmserve.model.bf16: bfloat16 weights in oneDNN's layout, float32 activations (CPUs with AVX512-BF16/AMX)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from llmserve.model import bf16
from llmserve.model.kinds import ProjectionKind


@pytest.fixture
def native(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_BF16", "1")
    if not bf16.supported():
        pytest.skip("this CPU has no native bfloat16 matmul")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """What the layer computes: rows and weights rounded to bfloat16, products summed in float32."""
    y = x.bfloat16().float() @ w.bfloat16().float().T
    return y if b is None else y + b


@pytest.mark.parametrize("rows", [1, 3, 16, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_bf16_reference(native, rows, bias):
    torch.manual_seed(rows)
    w, x = torch.randn(96, 64), torch.randn(rows, 64)
    b = torch.randn(96) if bias else None
    lin = bf16.BF16Linear(w, b)
    assert lin.packed is not None and lin.packed.is_mkldnn and lin._plain is None  # one copy: the packed one
    y = lin(x)
    assert y.dtype is torch.float32 and y.shape == (rows, 96)
    ref = reference(x, w, b)
    # the output is rounded to bfloat16 (8 bits of mantissa) before it is widened
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    assert torch.equal(lin.weight, w.bfloat16())
    assert lin.kernel_args() == (ProjectionKind.BF16, 0, [lin.packed]) if not bias else lin.kernel_args() is None


def test_linear_keeps_leading_dims_and_empty_rows(native):
    lin = bf16.BF16Linear(torch.randn(32, 16), None)
    assert lin(torch.randn(2, 5, 16)).shape == (2, 5, 32)
    assert lin(torch.randn(0, 16)).shape == (0, 32)


def test_without_native_bf16_plain_weight(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_BF16", "0")
    assert not bf16.supported()
    assert not bf16.native(torch.bfloat16, torch.device("cpu"))
    w = torch.randn(32, 16)
    lin = bf16.BF16Linear(w, None)
    assert lin.packed is None and lin.kernel_args() is None
    x = torch.randn(4, 16)
    torch.testing.assert_close(lin(x), reference(x, w, None), rtol=1e-2, atol=5e-2)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 16)
        self.norm = nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
        self.proj = nn.Linear(16, 16, bias=True)
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied


def test_to_bf16_replaces_layers_and_widens_the_rest(native):
    m = Tiny()
    emb = m.embed_tokens.weight.detach().clone()
    assert bf16.to_bf16(m) == 3
    assert isinstance(m.embed_tokens, bf16.BF16Embedding) and isinstance(m.lm_head, bf16.BF16Linear)
    assert isinstance(m.proj, bf16.BF16Linear) and m.proj.bias.dtype is torch.float32
    assert m.norm.dtype is torch.float32  # the activations' type
    ids = torch.tensor([[1, 7, 49]])
    assert m.embed_tokens(ids).dtype is torch.float32
    assert torch.equal(m.embed_tokens(ids), emb[ids].bfloat16().float())
    assert torch.equal(m.lm_head.weight, m.embed_tokens.weight)  # the tied head holds the same values
