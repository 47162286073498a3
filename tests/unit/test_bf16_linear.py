"""llmserve.model.formats.bf16: bfloat16 weights in oneDNN's layout, float32 activations (CPUs with AVX512-BF16/AMX)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from llmserve.model.formats import bf16
from llmserve.model.kernels.kinds import ProjectionKind


@pytest.fixture(params=["native", "emulate"])
def mode(request, monkeypatch):
    """Each path the bfloat16 mode can take: oneDNN's native matmul (only where the CPU has AVX512-BF16 / AMX) and
    the portable twin (LLMSERVE_CPU_BF16=emulate, on every CPU)."""
    monkeypatch.setenv("LLMSERVE_CPU_BF16", "1" if request.param == "native" else "emulate")
    if not bf16.supported():
        pytest.skip("this CPU has no native bfloat16 matmul (the emulated twin runs in its place)")
    return request.param


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
def test_linear_matches_bf16_reference(mode, rows, bias):
    torch.manual_seed(rows)
    w, x = torch.randn(96, 64), torch.randn(rows, 64)
    b = torch.randn(96) if bias else None
    lin = bf16.BF16Linear(w, b)
    if mode == "native":
        assert lin.packed is not None and lin.packed.is_mkldnn and lin._plain is None  # one copy: the packed one
    else:
        assert lin.packed is None and lin._plain.dtype is torch.bfloat16
    y = lin(x)
    assert y.dtype is torch.float32 and y.shape == (rows, 96)
    ref = reference(x, w, b)
    # the output is rounded to bfloat16 (8 bits of mantissa) before it is widened
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    assert torch.equal(lin.weight, w.bfloat16())
    args = lin.kernel_args()
    if bias:
        assert args is None
    else:
        assert args[:2] == (ProjectionKind.BF16, 0) and args[2][0] is (lin.packed if mode == "native" else lin._plain)


@pytest.mark.parametrize("rows", [1, 7, 64, 200])
def test_native_and_twin_agree(native, monkeypatch, rows):
    """On a CPU with the instruction, the twin that stands in for it elsewhere computes the same values: both round
    rows and weights to bfloat16 and the output to bfloat16, so they differ only where float32 sums in another order
    round to a neighbouring bfloat16 (one step: 2^-8 relative); at the bundled model's projection size."""
    torch.manual_seed(rows)
    w, x = torch.randn(768, 576), torch.randn(rows, 576)
    y_native = bf16.BF16Linear(w, None)(x)
    monkeypatch.setenv("LLMSERVE_CPU_BF16", "emulate")
    twin = bf16.BF16Linear(w, None)
    assert twin.packed is None
    y_twin = twin(x)
    # one bfloat16 step of the value, or for a value near zero (a sum that cancels) float32's error of the sum
    bound = 2**-7 * y_twin.abs() + 1e-4 * y_twin.abs().max()
    assert ((y_native - y_twin).abs() <= bound).all(), ((y_native - y_twin).abs() - bound).max()
    assert (y_native != y_twin).float().mean().item() < 0.05  # most outputs round to the same bfloat16


def test_linear_keeps_leading_dims_and_empty_rows(mode):
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
        self.register_buffer("scale", torch.ones(4, dtype=torch.float16))  # a quantized layer's (int4: float16)


def test_to_bf16_replaces_layers_and_widens_the_rest(mode):
    m = Tiny()
    emb = m.embed_tokens.weight.detach().clone()
    assert bf16.to_bf16(m) == 3
    assert isinstance(m.embed_tokens, bf16.BF16Embedding) and isinstance(m.lm_head, bf16.BF16Linear)
    assert isinstance(m.proj, bf16.BF16Linear) and m.proj.bias.dtype is torch.float32
    assert m.norm.dtype is torch.float32  # the activations' type
    assert m.scale.dtype is torch.float16  # as an int4 layer's kernels read it (--dtype bfloat16 --quantization int4)
    ids = torch.tensor([[1, 7, 49]])
    assert m.embed_tokens(ids).dtype is torch.float32
    assert torch.equal(m.embed_tokens(ids), emb[ids].bfloat16().float())
    assert torch.equal(m.lm_head.weight, m.embed_tokens.weight)  # the tied head holds the same values
