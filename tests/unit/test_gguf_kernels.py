"""llmserve/csrc/gguf_*.cpp against the gguf package's NumPy dequantization, on synthetic blocks of
every type (gguf_kernels.random_blocks: random bytes, the float16 scale fields set to finite values)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from llmserve.model.kernels import gguf_kernels as gk

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

QUANTIZED = [
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q8_0,
    Q.IQ4_NL,
    Q.MXFP4,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
    Q.IQ4_XS,
]
ALL = [Q.F32, Q.F16, Q.BF16] + QUANTIZED


@pytest.fixture(scope="module")
def ext():
    if (
        torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
        or not shutil.which("g++")
        or os.environ.get("LLMSERVE_CPU_KERNELS", "1") == "0"
    ):
        pytest.skip("no AVX2, no compiler or LLMSERVE_CPU_KERNELS=0: the NumPy / PyTorch fallbacks run instead")
    e = gk.gguf_kernels()
    assert e is not None, "the extension must build where AVX2 and a compiler exist"
    return e


@pytest.fixture(params=["avx512", "avx2", "twin"])
def variant(ext, request):
    """Every variant of the K-quant dots: AVX-512 VNNI (Q4_K, Q6_K; where the CPU has it), AVX2, and the VNNI ones'
    portable twin (any CPU: LLMSERVE_VNNI=twin, the VNNI CPUs' default path; the panels' twin from their row count)."""
    from llmserve import envs
    from llmserve.model.kernels import ops

    cpu = ops.cpu_kernels()
    cpu.set_avx512(request.param == "avx512")
    cpu.set_vnni_twin(request.param == "twin")
    if request.param == "avx512" and not ext.uses_avx512():
        cpu.set_avx512(bool(envs.LLMSERVE_AVX512))
        cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        pytest.skip("this CPU has no AVX-512 VNNI: the AVX2 kernels and the twin ('twin') are the ones tested")
    assert ext.uses_avx512() == (request.param == "avx512") and cpu.uses_vnni() == (request.param != "avx2")
    yield request.param
    cpu.set_avx512(bool(envs.LLMSERVE_AVX512))
    cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")


def reference(raw: torch.Tensor, qtype) -> torch.Tensor:
    if qtype == Q.BF16:  # (older gguf packages lack BF16's dequantization)
        return (raw.numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw.numpy(), qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (13, 4352)])
def test_dequantize_is_bit_exact(ext, qtype, n, k):
    raw = gk.random_blocks(qtype, n, k, seed=n + k)
    got = gk.dequantize(raw, qtype, k)
    want = torch.as_tensor(reference(raw, qtype))
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32).reshape(n, k))  # the same bits


def rounding_bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """|x @ w.T - x~ @ w.T| for x~ = x rounded to int8 per `block` values (scale dx = max|x| / 127, each
    value within dx / 2): at most sum over blocks of dx / 2 * sum |w| over the block; [M, N], float64."""
    M, K = x.shape
    dx = x.abs().reshape(M, K // block, block).amax(-1) / 127
    wsum = w.abs().reshape(w.shape[0], K // block, block).sum(-1)
    return 0.5 * dx @ wsum.t()


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64])
def test_linear(ext, variant, qtype, rows):
    n, k = 37, 768
    raw = gk.random_blocks(qtype, n, k, seed=rows)
    w = gk.dequantize(raw, qtype, k).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 5] *= 20  # an outlier: the per-block scales must follow it
    exact = x.double() @ w.t()
    scale = x.double().abs() @ w.abs().t()  # float32 accumulation: a relative error of the absolute sum
    # integer dots: x rounded per 256 values (K-quants) or 32 (the rest), within the rounding's bound
    block = 256 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 32
    got = gk.linear(x, raw, qtype, k, many_rows=rows + 1).double()
    assert ((got - exact).abs() <= rounding_bound(x.double(), w, block) + 1e-5 * scale).all()
    # the rounding errors are independent: typically far inside the worst case
    assert (got - exact).abs().mean() < 0.1 * rounding_bound(x.double(), w, block).mean()
    # dequantized tiles and at::mm: float32 accuracy
    tiled = gk.linear(x, raw, qtype, k, many_rows=rows).double()
    assert ((tiled - exact).abs() <= 1e-5 * scale).all()


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("fill", [0xFF, 0x80, 0x7F])
def test_linear_extreme_blocks(ext, variant, qtype, fill):
    """Every byte the same (largest quants, scales and mins; Q6_K's scale -128) and x at +-127 after
    rounding: the int16 / int32 sums must not overflow. Q4_0 / Q4_1 round x as llama.cpp's Q8_1 blocks, with a
    float16 scale and sum: +-1 comes back within 2^-11 of itself, not exact."""
    k = 512
    raw = gk.random_blocks(qtype, 3, k)
    scales = raw.clone()
    raw.fill_(fill)
    num = gk.qtype_number(qtype)
    fields = [(off, 2) for off in gk._HALF_FIELDS.get(num, ())] + ([(0, 1)] if qtype == Q.MXFP4 else [])
    for off, width in fields:  # keep the random float16 scales (MXFP4: its exponent byte)
        block = gguf.GGML_QUANT_SIZES[qtype][1]
        cols = torch.arange(0, raw.shape[1], block) + off
        for i in range(width):
            raw[:, cols + i] = scales[:, cols + i]
    w = gk.dequantize(raw, qtype, k).double()
    x = torch.tensor([[1.0] * k, [-1.0] * k, [1.0, -1.0] * (k // 2)])
    got = gk.linear(x, raw, qtype, k).double()
    rel = 2**-10 if qtype in (Q.Q4_0, Q.Q4_1) else 1e-5
    assert ((got - x.double() @ w.t()).abs() <= rel * (x.double().abs() @ w.abs().t()) + 1e-6).all()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_avx512_and_avx2_dots_agree(ext, qtype):
    """The AVX-512 VNNI dots sum the same integers as the AVX2 ones; only the float sums' order differs."""
    from llmserve.model.kernels import ops

    if not ext.uses_avx512():
        pytest.skip("this CPU has no AVX-512 VNNI (or LLMSERVE_AVX512=0)")
    k = 1024
    raw = gk.random_blocks(qtype, 50, k, seed=7)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(7))
    wide = gk.linear(x, raw, qtype, k)
    try:
        ops.cpu_kernels().set_avx512(False)
        narrow = gk.linear(x, raw, qtype, k)
    finally:
        ops.cpu_kernels().set_avx512(True)
    scale = x.abs() @ gk.dequantize(raw, qtype, k).abs().t()
    assert ((wide - narrow).abs() <= 1e-5 * scale).all()
    # each row of x alone gives the same bits as within the batch
    assert all(torch.equal(gk.linear(x[i : i + 1], raw, qtype, k)[0], wide[i]) for i in range(6))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_kquant_dot_twins_agree_bit_for_bit(ext, qtype):
    """The row-by-row AVX-512 VNNI dots of Q4_K and Q6_K and their portable twin give the same bits (the same integers,
    the same float operations in the same order) at every row count of their 4-row blocks and after them: the twin,
    run on every CPU, checks the VNNI CPUs' default path."""
    from llmserve import envs
    from llmserve.model.kernels import cpu_ext, ops

    cpu = ops.cpu_kernels()
    k = 1024
    raw = gk.random_blocks(qtype, 37, k, seed=12)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(12))
    x[:, 5] *= 20
    try:
        cpu.set_kquant_panels(1 << 62)
        cpu.set_vnni_twin(False)
        if not cpu.vnni_real():
            pytest.skip("no AVX-512 VNNI here (or LLMSERVE_AVX512=0): only the twin runs (test_linear[twin-...])")
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
            cpu.set_vnni_twin(False)
            wide = gk.linear(x[:rows], raw, qtype, k)
            cpu.set_vnni_twin(True)
            assert torch.equal(wide, gk.linear(x[:rows], raw, qtype, k)), rows
    finally:
        cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        cpu_ext._set_kquant_panels(cpu_ext.kernel_config())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_kquant_dot_twin_runs_on_any_cpu(ext, qtype):
    """set_vnni_twin(True) runs the VNNI dots' twin even where AVX-512 is off or missing: the AVX2 dots' integers,
    summed over 16 lanes instead of 8 (float rounding apart, the same result; not the same bits: the twin ran)."""
    from llmserve import envs
    from llmserve.model.kernels import cpu_ext, ops

    cpu = ops.cpu_kernels()
    k = 1024
    raw = gk.random_blocks(qtype, 64, k, seed=13)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(13))
    try:
        cpu.set_kquant_panels(1 << 62)
        cpu.set_avx512(False)
        cpu.set_vnni_twin(False)
        assert not cpu.uses_vnni()
        narrow = gk.linear(x, raw, qtype, k)
        assert cpu.set_vnni_twin(True) and not cpu.vnni_real()
        twin = gk.linear(x, raw, qtype, k)
    finally:
        cpu.set_avx512(bool(envs.LLMSERVE_AVX512))
        cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        cpu_ext._set_kquant_panels(cpu_ext.kernel_config())
    scale = x.abs() @ gk.dequantize(raw, qtype, k).abs().t()
    assert ((twin - narrow).abs() <= 1e-5 * scale).all()
    assert not torch.equal(twin, narrow)


@pytest.mark.parametrize("rows", [1, 3, 6, 40])
def test_linear_parts_side_by_side(ext, variant, rows):
    """A packed projection's parts of different types (Q4_K_M's q, k, v; a Q5_0 part; Q8_0 and Q4_0 parts
    repacked for llmserve's own int8 / int4 kernels) in one call: the same bits as each part's linear, side by
    side."""
    from llmserve.model.kernels.kinds import PACKED_PART, ProjectionKind

    k = 512
    tensors, codes, want = [], [], []
    x = torch.randn(rows, k)
    parts = (("Q4_K", 40), ("Q4_K", 9), ("Q8_0", 17), ("Q6_K", 9), ("Q4_0", 64), ("Q5_0", 3))
    parts += (("Q3_K", 11), ("Q2_K", 5), ("IQ4_XS", 7), ("IQ4_NL", 6))  # (Q3_K_M / Q2_K / IQ4_XS files' mixes)
    parts += (("MXFP4", 4),)  # (gpt-oss files: MXFP4 experts)
    for q, n in parts:
        raw, num = gk.random_blocks(q, n, k, seed=n), gk.qtype_number(q)
        want.append(gk.linear(x, raw, num, k))
        if num in gk.PACKED:
            kind, ts = gk.repack(raw, num)
            tensors += ts
            codes.append(PACKED_PART + (ProjectionKind.INT4 if kind == "int4" else ProjectionKind.INT8))
        else:
            tensors.append(raw)
            codes.append(num)
    got = ext.linear_parts(x, tensors, codes, 1 << 62)
    assert torch.equal(got, torch.cat(want, dim=1))
    with pytest.raises(RuntimeError, match="not a type of GGUF's integer dots"):
        ext.linear_parts(x, [gk.random_blocks("F16", 3, k)], [1], 1 << 62)
    with pytest.raises(RuntimeError, match="not a type of GGUF's integer dots"):  # Q8_0's blocks come repacked
        ext.linear_parts(x, [gk.random_blocks("Q8_0", 3, k)], [8], 1 << 62)


def _q8_1(x: torch.Tensor, fp16: bool):
    """x [M, K] rounded per 32 values as llama.cpp's Q8_1 (`fp16`: d and s = d * sum(q) stored in float16) or with
    float32 d and the float sum of x (llmserve before): q [M, K/32, 32], d [M, K/32], s [M, K/32], float64."""
    b = x.double().reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1)
    d = (amax / 127).float()
    q = torch.round(b * (127 / amax).unsqueeze(-1).float().double())  # x * (127 / amax) in float32, rounded
    if fp16:
        return q, d.half().double(), (d * q.sum(-1).float()).half().double()
    return q, d.double(), b.sum(-1)


@pytest.mark.parametrize("rows", [3, 80], ids=["dots", "vnni-gemm"])
def test_q4_1_rounds_x_as_llama_cpp_q8_1(ext, variant, rows):
    """Q4_1 x Q8_1, as llama.cpp computes it: per 32-value block d_w * d_x * sum(q_w * q_x) + m_w * s_x, where x's
    scale d_x and its block sum s_x = d_x * sum(q_x) are float16 (not the float sum of x). A GGUF's blocks (the
    gguf mode: gk.linear, q4_linear's q8_1) land within float32 noise of that and clearly off the float-sum variant
    (the min term is what moves: 95.8% -> 97%+ of positions teacher-forced equal to llama.cpp's on the bundled Q4_1
    file); llmserve's own int4 mode (q8_1 off) keeps the float32 scale and float sum, the variant closer to float32.
    80 rows: q4_linear's many-rows VNNI GEMM where it runs (its twin under 'twin'), the dots elsewhere."""
    from llmserve.model.kernels import ops

    n, k = 64, 512
    raw = gk.random_blocks(Q.Q4_1, n, k, seed=5)
    blocks = raw.reshape(n, k // 32, 20)
    dw = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).double()
    mw = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).double()
    nib = blocks[..., 4:].long()
    qw = torch.cat([nib & 15, nib >> 4], dim=-1).double()  # low nibbles are values 0..15, high 16..31
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)) * 2
    want = {}
    for fp16 in (True, False):
        qx, dx, sx = _q8_1(x, fp16)
        dots = torch.einsum("mbi,nbi->mnb", qx, qw)
        want[fp16] = (dw[None] * dx[:, None] * dots + mw[None] * sx[:, None]).sum(-1)
    scale = x.double().abs() @ gk.dequantize(raw, Q.Q4_1, k).double().abs().t()
    kind, tensors = gk.repack(raw, Q.Q4_1)
    many = ops.kernel_config().int4_vnni_rows if ops.int4_vnni(n) else 1 << 62
    for q8_1, got in (
        (True, gk.linear(x, raw, Q.Q4_1, k, many_rows=1 << 62).double()),
        (True, ext.q4_linear(x, *tensors, many, True).double()),
        (False, ext.q4_linear(x, *tensors, many, False).double()),
        (False, ext.q4_linear(x, *tensors, many).double()),  # (the default: int4 mode's rounding)
    ):
        assert ((got - want[q8_1]).abs() <= 2e-6 * scale + 1e-6).all(), q8_1
        assert (got - want[q8_1]).abs().mean() < 0.1 * (want[not q8_1] - want[q8_1]).abs().mean(), q8_1


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_repack_keeps_every_value(qtype):
    """Q4_0 / Q4_1 / Q8_0 in llmserve's packed layout stand for the blocks' exact values (Q4_0's zeros may carry
    the other sign: q * d - 8 d against d * (q - 8))."""
    raw = gk.random_blocks(qtype, 11, 256, seed=3)
    kind, tensors = gk.repack(raw, qtype)
    assert kind == ("int8" if qtype == Q.Q8_0 else "int4")
    want = torch.as_tensor(reference(raw, qtype)).reshape(11, 256)
    assert torch.equal(gk.packed_dequantize(kind, tensors), want)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_linear_plain_types(ext, qtype):
    raw = gk.random_blocks(qtype, 9, 40)
    x = torch.randn(3, 40)
    w = gk.dequantize(raw, qtype, 40).double()
    assert torch.allclose(gk.linear(x, raw, qtype, 40).double(), x.double() @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q3_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_linear_strided_inputs(ext, qtype):
    k = 512
    raw = gk.random_blocks(qtype, 11, k)
    x = torch.randn(k, 3).t()  # not contiguous
    want = gk.linear(x.contiguous(), raw, qtype, k)
    assert torch.equal(gk.linear(x, raw, qtype, k), want)
    # rows of a wider buffer (raw.stride(0) > row_bytes): read in place
    wide = torch.zeros(11, raw.shape[1] + 64, dtype=torch.uint8)
    wide[:, : raw.shape[1]] = raw
    assert torch.equal(gk.linear(x, wide[:, : raw.shape[1]], qtype, k), want)
    assert torch.equal(gk.dequantize(wide[:, : raw.shape[1]], qtype, k), gk.dequantize(raw, qtype, k))


def test_the_bundled_files_tensors(ext, bundled_gguf):
    """Real blocks: one tensor of each type in the bundled SmolLM2 file (Q4_1, Q8_0, F32), read in place."""
    reader = gguf.GGUFReader(bundled_gguf)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        raw, num, k = gk.from_reader(t)
        raw = raw[:300]  # (the embeddings: 49,152 rows)
        want = torch.as_tensor(reference(raw, t.tensor_type)).reshape(raw.shape[0], k)
        assert torch.equal(gk.dequantize(raw, num, k), want), t.name
        x = torch.randn(2, k)
        got = gk.linear(x, raw, num, k).double()
        exact = x.double() @ want.double().t()
        tol = 1e-5 * (x.double().abs() @ want.double().abs().t())
        if t.tensor_type != Q.F32:  # the integer dots: x rounded per 32 values
            tol += rounding_bound(x.double(), want.double(), 32)
        assert ((got - exact).abs() <= tol).all(), t.name
    assert {t.name for t in seen} == {"Q4_1", "Q8_0", "F32"}


def test_empty_shapes(ext):
    raw = gk.random_blocks(Q.Q4_K, 5, 256)
    assert gk.linear(torch.zeros(0, 256), raw, Q.Q4_K, 256).shape == (0, 5)
    assert gk.linear(torch.zeros(2, 256), raw[:0], Q.Q4_K, 256).shape == (2, 0)


def test_qtype_spellings(ext):
    raw = gk.random_blocks(Q.Q6_K, 3, 256)
    want = gk.dequantize(raw, Q.Q6_K, 256)
    assert torch.equal(gk.dequantize(raw, 14, 256), want) and torch.equal(gk.dequantize(raw, "q6_k", 256), want)


def test_bad_arguments_raise(ext):
    raw = gk.random_blocks(Q.Q4_K, 4, 512)
    x = torch.randn(2, 512)
    with pytest.raises(ValueError, match="unsupported"):
        gk.linear(x, raw, Q.IQ2_XXS, 512)
    with pytest.raises(ValueError, match="unsupported"):
        gk.dequantize(raw, "Q7_Z", 512)
    with pytest.raises(ValueError, match="bytes a row"):
        gk.linear(x, raw, Q.Q4_K, 256)
    with pytest.raises(ValueError, match="multiple"):
        gk.dequantize(raw, Q.Q4_K, 300)
    with pytest.raises(ValueError, match=r"x must be \[M, 512\]"):
        gk.linear(torch.randn(2, 256), raw, Q.Q4_K, 512)
    with pytest.raises(ValueError, match="uint8"):
        gk.dequantize(raw.float(), Q.Q4_K, 512)
    # the extension checks too, for callers that skip the Python layer
    with pytest.raises(RuntimeError, match="unsupported"):
        ext.linear(x, raw, int(Q.IQ2_XXS), 512, 32)
    with pytest.raises(RuntimeError, match="bytes a row"):
        ext.dequantize(raw, 12, 256)
    with pytest.raises(RuntimeError, match="columns"):
        ext.linear(torch.randn(2, 256), raw, 12, 512, 32)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.dequantize(torch.zeros(4, 2 * raw.shape[1], dtype=torch.uint8)[:, ::2], 12, 512)
    with pytest.raises(RuntimeError, match="float32"):
        ext.linear(x.double(), raw, 12, 512, 32)


def test_fallback_without_the_extension(monkeypatch):
    """LLMSERVE_CPU_KERNELS=0 or no compiler: the NumPy dequantization and a float32 matmul."""
    monkeypatch.setattr(gk, "_TRIED", True)
    monkeypatch.setattr(gk, "_EXT", None)
    raw = gk.random_blocks(Q.Q4_K, 6, 256)
    w = gk.dequantize(raw, Q.Q4_K, 256)
    assert torch.equal(w, torch.as_tensor(reference(raw, Q.Q4_K)))
    x = torch.randn(2, 256)
    assert torch.allclose(gk.linear(x, raw, Q.Q4_K, 256), x @ w.t())


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_linear_f32_is_float32_exact(ext, qtype, rows):
    """The float32-exact product (llmserve's default for GGUF layers): x as it is, the weights widened, sums
    in float32 (few rows: each weight row widened in L1; many: tiles and at::mm); close to float64's."""
    k = 512 if qtype not in (Q.F32, Q.F16, Q.BF16) else 40
    raw = gk.random_blocks(qtype, 37, k, seed=rows)
    x = torch.randn(rows, k)
    w = torch.as_tensor(reference(raw, qtype)).double()
    want = x.double() @ w.t()
    scale = x.double().abs() @ w.abs().t()
    for few in (0, 16, 64):
        got = gk.linear_f32(x, raw, qtype, k, few).double()
        assert ((got - want).abs() <= 1e-5 * scale + 1e-6).all(), (qtype, rows, few)


def test_mxfp4_checkpoint_rows_are_transformers_values():
    """gpt-oss's Hugging Face MXFP4 experts (blocks [E, N, G, 16], E8M0 exponents [E, N, G]) as GGUF MXFP4 rows
    (llmserve.model.families.gpt_oss.mxfp4_rows) stand for transformers' own dequantization value for value (subnormal
    exponents 0 and 1 included; bit for bit but E2M1's -0, which GGUF's table holds as +0), and for the gguf
    package's bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from llmserve.model.families.gpt_oss import MXFP4, mxfp4_rows

    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (2, 6, 3), generator=g, dtype=torch.uint8)
    scales[0, 0, :2] = torch.tensor([0, 1], dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    for e in range(2):
        raw = mxfp4_rows(blocks[e], scales[e])
        assert raw.shape == (6, 3 * 17)
        got = gk.dequantize(raw, MXFP4, 96)
        ref = want[e].t().contiguous()
        assert torch.equal(got, ref)
        nonzero = ref != 0
        assert torch.equal(got[nonzero].view(torch.int32), ref[nonzero].view(torch.int32))
        assert torch.equal(got.view(torch.int32), torch.as_tensor(reference(raw, Q.MXFP4)).view(torch.int32))


# GGUF's K-quants of unsigned values: many rows take the panels (csrc/gguf_panels.cpp)
PANEL_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(params=["avx512", "twin"])
def panels(ext, request):
    """The panels from 1 row on: their AVX-512 VNNI kernels (where the CPU has them) or the portable twin (any CPU:
    the default path of a VNNI CPU, computed the same way)."""
    from llmserve import envs
    from llmserve.model.kernels import cpu_ext, ops

    cpu = ops.cpu_kernels()
    if request.param == "avx512" and not cpu.vnni_real():
        pytest.skip("this CPU has no AVX-512 VNNI: the portable twin ('twin') stands in for the panels' kernels")
    cpu.set_kquant_panels(1)
    cpu.set_vnni_twin(request.param == "twin")
    yield request.param
    cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
    cpu_ext._set_kquant_panels(cpu_ext.kernel_config())


def row_by_row(x, raw, qtype, k):
    from llmserve.model.kernels import cpu_ext, ops

    ops.cpu_kernels().set_kquant_panels(1 << 62)
    try:
        return gk.linear(x, raw, qtype, k)
    finally:
        cpu_ext._set_kquant_panels(cpu_ext.kernel_config())


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,n", [(1, 16), (5, 37), (17, 70), (64, 33)])
def test_kquant_panels_sum_what_the_row_by_row_dots_sum(ext, panels, qtype, rows, n):
    """The panels' integers are the row-by-row dots' (x rounded per 256 values): results agree to float rounding
    (the float sums run per super-block instead of per lane), for whole panels and the rows after the last one.
    (Here from 1 row for Q4_K / Q5_K, 3 for the 16-value-group types.)"""
    k = 768
    raw = gk.random_blocks(qtype, n, k, seed=rows + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 5] *= 20
    got = gk.linear(x, raw, qtype, k)
    alone = gk.linear(x[-3:], raw, qtype, k)[-1]  # (3 rows: Q2_K / Q3_K / Q6_K take panels from 3x the row count)
    want = row_by_row(x, raw, qtype, k)  # (then the configured row count again)
    w = gk.dequantize(raw, qtype, k).double()
    scale = x.double().abs() @ w.abs().t()
    assert ((got.double() - want.double()).abs() <= 1e-5 * scale + 1e-6).all()
    assert not torch.equal(got[:, :16], want[:, :16]) or rows < 3  # the panels ran (their float sums differ)
    assert torch.equal(alone, got[-1])  # a row's result does not depend on how many rows are beside it


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_kquant_panel_twins_agree_bit_for_bit(ext, qtype):
    """The AVX-512 VNNI panels and their portable twin give the same bits (the same integers, the same float
    operations in the same order): the twin, run on every CPU, checks the VNNI CPUs' default path."""
    from llmserve import envs
    from llmserve.model.kernels import cpu_ext, ops

    cpu = ops.cpu_kernels()
    if not cpu.vnni_real() and envs.LLMSERVE_VNNI != "twin":
        pytest.skip("this CPU has no AVX-512 VNNI: only the twin runs here (test_kquant_panels_sum_...[twin])")
    k = 1024
    raw = gk.random_blocks(qtype, 48, k, seed=11)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(11))
    try:
        cpu.set_kquant_panels(1)
        cpu.set_vnni_twin(False)
        if not cpu.vnni_real():
            pytest.skip("this CPU has no AVX-512 VNNI: only the twin runs here (test_kquant_panels_sum_...[twin])")
        wide = gk.linear(x, raw, qtype, k)
        cpu.set_vnni_twin(True)
        twin = gk.linear(x, raw, qtype, k)
    finally:
        cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        cpu_ext._set_kquant_panels(cpu_ext.kernel_config())
    assert torch.equal(wide, twin)


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fill", [0xFF, 0x80, 0x7F])
def test_kquant_panels_extreme_blocks(ext, panels, qtype, fill):
    """Largest quants, scales and mins (Q6_K's scale -128), x at +-127 after rounding: no int32 sum overflows."""
    k = 512
    raw = gk.random_blocks(qtype, 16, k)
    scales = raw.clone()
    raw.fill_(fill)
    block = gguf.GGML_QUANT_SIZES[qtype][1]
    for off in gk._HALF_FIELDS.get(gk.qtype_number(qtype), ()):
        cols = torch.arange(0, raw.shape[1], block) + off
        raw[:, cols] = scales[:, cols]
        raw[:, cols + 1] = scales[:, cols + 1]
    w = gk.dequantize(raw, qtype, k).double()
    x = torch.tensor([[1.0] * k, [-1.0] * k, [1.0, -1.0] * (k // 2)])
    got = gk.linear(x, raw, qtype, k).double()
    assert ((got - x.double() @ w.t()).abs() <= 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6).all()


def test_kquant_panels_start_at_their_row_count(ext):
    """Below KernelConfig.kquant_panel_rows rows the row-by-row dots run, from there the panels (where the VNNI
    kernels run: the instructions, or here their twin); LLMSERVE_KQUANT_PANELS=0 keeps the dots at every row count."""
    from llmserve import envs
    from llmserve.model.kernels import cpu_ext, ops

    rows = cpu_ext.kernel_config().kquant_panel_rows
    k, qtype = 512, Q.Q4_K
    raw = gk.random_blocks(qtype, 32, k, seed=5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
    cpu = ops.cpu_kernels()
    try:
        cpu.set_vnni_twin(True)
        assert torch.equal(gk.linear(x[: rows - 1], raw, qtype, k), row_by_row(x[: rows - 1], raw, qtype, k))
        assert not torch.equal(gk.linear(x, raw, qtype, k), row_by_row(x, raw, qtype, k))
    finally:
        cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")


# Q4_K and Q6_K repacked at load into panels of 16 rows (csrc/gguf_repacked.cpp): one kernel at every row count
REPACKED = [Q.Q4_K, Q.Q6_K]


def panels_twin(x, raw, qtype, k):
    """The dots of x through the panels packed per call (their portable twin, from 1 row on; Q6_K's from 3 rows:
    x padded to 3, a row's result not depending on the rows beside it)."""
    from llmserve import envs
    from llmserve.model.kernels import cpu_ext, ops

    cpu = ops.cpu_kernels()
    try:
        cpu.set_kquant_panels(1)
        cpu.set_vnni_twin(True)
        return gk.linear(torch.cat([x, torch.ones(max(0, 3 - len(x)), k)]), raw, qtype, k)[: len(x)]
    finally:
        cpu.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        cpu_ext._set_kquant_panels(cpu_ext.kernel_config())


@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 37])
@pytest.mark.parametrize("n,k", [(16, 256), (48, 768), (32, 2560)])
def test_repacked_panels_give_the_panels_bits(ext, panels, qtype, rows, n, k):
    """The repacked layout holds every value (its dequantization is the file's, bit for bit), and its dots are the
    panels' integers and float operations at every row count: the same bits, from its AVX-512 VNNI kernel or its
    twin (`panels`), whether x has 1 row or 37 (a row's result never depends on the rows beside it). K = 2560 runs
    over more than one span of 8 super-blocks (many rows: the sums carried in the output)."""
    raw = gk.random_blocks(qtype, n, k, seed=rows * n)
    kind, (packed,) = gk.repack_panels(raw, qtype, k)
    assert kind == {Q.Q4_K: "q4k16", Q.Q6_K: "q6k16"}[qtype]
    assert packed.shape == (n, k // 256 * {Q.Q4_K: 148, Q.Q6_K: 210}[qtype])
    assert torch.equal(gk.packed_dequantize(kind, [packed]), gk.dequantize(raw, qtype, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 7] *= 30
    got = gk.packed_linear(x, kind, [packed])
    assert torch.equal(got, panels_twin(x, raw, qtype, k))
    assert torch.equal(gk.packed_linear(x[-1:], kind, [packed])[0], got[-1])
    want = row_by_row(x, raw, qtype, k)  # the file's blocks, row by row: the same integers, float sums per lane
    scale = x.double().abs() @ gk.dequantize(raw, qtype, k).double().abs().t()
    assert ((got.double() - want.double()).abs() <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("fill", [0xFF, 0x80, 0x7F])
def test_repacked_panels_extreme_blocks(ext, panels, qtype, fill):
    """Largest quants, scales and mins (Q6_K's scale -128), x at +-127 after rounding: no int32 sum overflows in the
    repacked kernel."""
    k = 512
    raw = gk.random_blocks(qtype, 16, k)
    halves = raw.clone()
    raw.fill_(fill)
    block = gguf.GGML_QUANT_SIZES[qtype][1]
    for off in gk._HALF_FIELDS[gk.qtype_number(qtype)]:
        cols = torch.arange(0, raw.shape[1], block) + off
        raw[:, cols], raw[:, cols + 1] = halves[:, cols], halves[:, cols + 1]
    kind, tensors = gk.repack_panels(raw, qtype, k)
    x = torch.tensor([[1.0] * k, [-1.0] * k, [1.0, -1.0] * (k // 2)])
    w = gk.dequantize(raw, qtype, k).double()
    got = gk.packed_linear(x, kind, tensors).double()
    assert ((got - x.double() @ w.t()).abs() <= 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6).all()


def test_repack_takes_rows_in_sixteens_and_three_types(ext):
    """Only whole panels of Q4_K, Q6_K or MXFP4: 40 rows, or a Q5_K tensor, are refused with a clear error (GGUFLinear
    keeps such a part's blocks as the file has them: ops.kquant_repack)."""
    from llmserve.model.kernels import ops

    with pytest.raises(RuntimeError, match="multiple of 16"):
        gk.repack_panels(gk.random_blocks(Q.Q4_K, 40, 256), Q.Q4_K, 256)
    with pytest.raises(ValueError, match="not repacked"):
        gk.repack_panels(gk.random_blocks(Q.Q5_K, 16, 256), Q.Q5_K, 256)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        gk.repack_panels(gk.random_blocks(Q.MXFP4, 24, 64), Q.MXFP4, 64)
    assert not ops.kquant_repack(12, 40) and not ops.kquant_repack(13, 48) and not ops.kquant_repack(39, 24)


def mxfp4_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random MXFP4 blocks with normal scales (the tests of subnormal ones are test_linear's and the extremes')."""
    raw = gk.random_blocks(Q.MXFP4, n, k, seed=seed)
    raw.view(n, k // 32, 17)[:, :, 0] = torch.randint(
        118, 126, (n, k // 32), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    return raw


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 37])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 2880), (32, 1312)])
def test_mxfp4_repacked_panels(ext, panels, rows, n, k):
    """gpt-oss's MXFP4 experts repacked into panels of 16 rows ("mx16", the file's bytes reordered): every value kept
    (its dequantization is the file's, bit for bit), and its dots are the row-by-row dots' integers (block32_dot) up
    to float rounding, the same bits from the AVX-512 VNNI kernel and its portable twin at every row count, a row's
    result independent of the rows beside it. K = 1312 and 2880 take more than one span of 32 blocks (many rows)."""
    from llmserve.model.kernels import ops

    raw = mxfp4_blocks(n, k, seed=rows * n)
    kind, (packed,) = gk.repack_panels(raw, Q.MXFP4, k)
    assert kind == "mx16" and packed.shape == raw.shape
    assert torch.equal(gk.packed_dequantize(kind, [packed]), gk.dequantize(raw, Q.MXFP4, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 7] *= 30
    got = gk.packed_linear(x, kind, [packed])
    cpu = ops.cpu_kernels()
    cpu.set_vnni_twin(True)
    try:
        assert torch.equal(got, gk.packed_linear(x, kind, [packed]))
    finally:
        cpu.set_vnni_twin(panels == "twin")
    assert torch.equal(gk.packed_linear(x[-1:], kind, [packed])[0], got[-1])
    want = gk.linear(x, raw, Q.MXFP4, k)  # the file's blocks, row by row: the same integers, float sums per lane
    scale = x.double().abs() @ gk.dequantize(raw, Q.MXFP4, k).double().abs().t()
    assert ((got.double() - want.double()).abs() <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("fill", [0x77, 0xFF, 0x88])
@pytest.mark.parametrize("exponent", [0, 1, 127, 200])
def test_mxfp4_repacked_extreme_blocks(ext, panels, fill, exponent):
    """The largest values (+-12 doubled: nibbles 7 and 15), the zero of either sign (8), x at +-127 after rounding, and
    E8M0 exponents 0 and 1 (ggml's subnormal halves) to 200: no int32 sum overflows, every scale as ggml reads it."""
    k = 512
    raw = torch.full((16, k // 32 * 17), fill, dtype=torch.uint8)
    raw.view(16, k // 32, 17)[:, :, 0] = exponent
    kind, tensors = gk.repack_panels(raw, Q.MXFP4, k)
    x = torch.tensor([[1.0] * k, [-1.0] * k, [1.0, -1.0] * (k // 2)])
    w = gk.dequantize(raw, Q.MXFP4, k).double()
    got = gk.packed_linear(x, kind, tensors).double()
    assert ((got - x.double() @ w.t()).abs() <= 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-300).all()
