"""llmserve/csrc/'s linear kernels (dots, GEMV, GEMM, VNNI, the head's argmax) against plain PyTorch (odd sizes);
norms, rotary and attention: test_cpu_attention.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model.formats.quant import QuantLinear, pack_int4, quantize_int4, unpack_int4
from llmserve.model.kernels import cpu_ext, ops


def close(a, b, rel=1e-5):
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-6)


def test_int4_pack_roundtrip():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 40])
def test_q4_linear(ext, rows):
    torch.manual_seed(rows)
    w = torch.randn(200, 96)
    q, scale, lo = quantize_int4(w)
    lin = QuantLinear("int4", pack_int4(q), scale, lo, None)
    ref = lin.dequantize()
    x = torch.randn(rows, 96)
    # the tiled float32 path; the integer-dot path, x rounded to int8 per 32 values (~1/254 each)
    assert close(ext.q4_linear(x, lin.qweight, lin.scale, lin.minv, 1), x @ ref.t(), 2e-4)
    assert close(ext.q4_linear(x, lin.qweight, lin.scale, lin.minv, 10**9), x @ ref.t(), 2e-2)


@pytest.mark.parametrize("rows,k", [(1, 64), (2, 72), (3, 576), (4, 8), (5, 64), (1, 12)])
def test_f32_linear(ext, rows, k):
    torch.manual_seed(k)
    w, x = torch.randn(70, k), torch.randn(rows, k)
    # rows >= 5 and K not a multiple of 8 go to at::linear; the rest through the GEMV kernel
    assert close(ext.f32_linear(x, w, 5), x @ w.t(), 1e-5)
    assert close(ext.f32_linear(x.t().contiguous().t(), w, 5), x @ w.t(), 1e-5)  # strided x


@pytest.mark.parametrize("engine", ["aten", "onednn"])
def test_gemm_engines_compute_the_same_product(ext, engine):
    """Both float32 GEMM engines (KernelConfig.gemm) give x @ w.T at any row count: oneDNN's rows are padded up to
    a bucket (65 -> 80, 517 -> 576) and the padding never shows; the many-rows paths of the quantized kernels
    and of f32_linear run through the same engine."""
    from llmserve.config import KernelConfig

    if engine == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    saved = ops.configure(KernelConfig(gemm=engine, int8_gemm=False))  # q8_linear's float32 tiles, not _int_mm
    try:
        assert ops.gemm_engine() == engine
        torch.manual_seed(0)
        w = torch.randn(300, 96)
        for m in (1, 5, 64, 65, 130, 517):
            x = torch.randn(m, 96)
            y = ext.gemm(x, w)
            assert y.shape == (m, 300) and y.is_contiguous()
            assert close(y, x @ w.t(), 1e-5)
            assert close(ext.f32_linear(x, w, 1), x @ w.t(), 1e-5)
            q, scale = ops.quantize_int8_per_channel(w)
            assert close(ext.q8_linear(x, q, scale[:, None], 1, 16), x @ (q.float() * scale[:, None]).t(), 1e-5)
        assert ext.gemm(torch.empty(0, 96), w).shape == (0, 300)
    finally:
        ops.configure(saved)


def test_gemv_gemm_crossover_is_measured_per_shape_or_fixed(ext):
    """KernelConfig.gemv_rows None: the rows from which at::linear takes over are measured once per weight
    shape (one of the calibration row counts, or past the largest); a number fixes it for every shape.
    ops.linear is x @ w.T either side of it."""
    from llmserve.config import KernelConfig

    w = torch.randn(96, 64)
    saved = ops.configure(KernelConfig(calibration_rows=(2, 4, 8)))
    try:
        cpu_ext._CROSSOVERS.clear()
        rows = ops.gemm_rows(w)
        assert rows in (2, 4, 8, 9)
        assert cpu_ext._CROSSOVERS == {(96, 64, torch.get_num_threads(), False): rows}
        assert ops.gemm_rows(torch.randn(96, 12)) == 0  # K not a multiple of 8: at::linear always
        for m in (1, 3, 9):
            x = torch.randn(m, 64)
            assert close(ops.linear(x, w), x @ w.t(), 1e-5)
        ops.configure(KernelConfig(gemv_rows=5))
        assert ops.gemm_rows(w) == 6
    finally:
        ops.configure(saved)
        cpu_ext._CROSSOVERS.clear()


def test_packed_weights_compute_the_same_product(ext):
    """A float32 weight in oneDNN's blocked layout (ops.pack_weight): in place of the plain weight, oneDNN's
    matmul at every row count; as a copy beside it, the GEMV below the measured crossover and oneDNN on the copy
    from there (ops.linear, the fused decode stack's kinds 0 and 1). x @ w.T at any row count either way;
    packed_weights False packs nothing, True replaces whatever the size, auto replaces from packed_min_elements."""
    from llmserve.config import KernelConfig

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    saved = ops.configure(KernelConfig(gemm="onednn", calibration_rows=(2, 4)))
    try:
        torch.manual_seed(0)
        w = torch.randn(300, 96)
        packed, replaces = ops.pack_weight(w)
        assert packed.is_mkldnn and packed.shape == w.shape and not replaces  # auto: a small weight keeps both
        assert torch.equal(packed.to_dense(), w)
        for m in (1, 3, 5, 64, 65, 517):
            x = torch.randn(m, 96)
            assert close(ops.linear(x, packed), x @ w.t(), 1e-5)
            assert close(ops.linear(x, w, packed), x @ w.t(), 1e-5)
            assert close(ext.f32_linear(x, packed, 1 << 30), x @ w.t(), 1e-5)  # packed: never the GEMV
        assert ext.gemm(torch.empty(0, 96), packed).shape == (0, 300)
        ops.configure(KernelConfig(gemm="onednn", packed_weights=False))
        assert ops.pack_weight(w) == (None, False)
        ops.configure(KernelConfig(gemm="onednn", packed_weights=True))
        assert ops.pack_weight(w)[1]
        ops.configure(KernelConfig(gemm="onednn", packed_min_elements=300 * 96))
        assert ops.pack_weight(w)[1]
        ops.configure(KernelConfig(gemm="aten"))
        assert ops.pack_weight(w) == (None, False)  # oneDNN's layout is for oneDNN's matmul only
    finally:
        ops.configure(saved)
        cpu_ext._CROSSOVERS.clear()


@pytest.fixture(params=["vnni", "twin"])
def vnni(ext, request):
    """The VNNI kernels on the instructions (where the CPU has them) or their portable twins (any CPU: the same
    bits, LLMSERVE_VNNI=twin)."""
    from llmserve import envs

    ext.set_vnni_twin(request.param == "twin")
    if request.param == "vnni" and not ext.vnni_real():
        ext.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        pytest.skip("no AVX-512 VNNI on this CPU: the portable twins ('twin') are the ones tested")
    yield request.param
    ext.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")


def test_vnni_twins_give_the_instructions_bits(ext):
    """int8 (q8_vnni_gemm) and int4 (q4_vnni_gemm) integer GEMMs: the portable twins that run the VNNI CPUs' default
    path on any CPU give the instructions' result bit for bit."""
    from llmserve import envs
    from llmserve.model.formats.quant import pack_int4, quantize_int4
    from llmserve.model.kernels import cpu_ext

    ext.set_vnni_twin(False)
    if not ext.vnni_real():
        ext.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        pytest.skip("no AVX-512 VNNI on this CPU: the twins are checked against _int_mm and the dots instead")
    torch.manual_seed(1)
    q, scale = ops.quantize_int8_per_channel(torch.randn(80, 96))
    wv, csum = ops.vnni_pack(q)
    q4, s4, lo = quantize_int4(torch.randn(128, 96))
    qw, s4, lo = pack_int4(q4), s4.half().contiguous(), lo.half().contiguous()
    q8b, s8b = ops.quantize_int8_per_channel(torch.randn(128, 128).reshape(-1, 32))  # Q8_0-like: a scale per 32
    q8b, s8b = q8b.reshape(128, 128), s8b.reshape(128, 4).contiguous()
    ext.set_q8_block_rows(1)
    try:
        for m in (1, 5, 300):
            x, x8 = torch.randn(m, 96) * 3, torch.randn(m, 128)
            got = {}
            for twin in (False, True):
                ext.set_vnni_twin(twin)
                got[twin] = [ext.q8_vnni_gemm(x, wv, csum, scale[:, None].contiguous(), b) for b in (8, 16)]
                got[twin].append(ext.q4_linear(x, qw, s4, lo, 1))
                got[twin].append(ext.q8_linear(x8, q8b, s8b, 1 << 62, 8))
            assert all(torch.equal(a, b) for a, b in zip(got[False], got[True])), m
    finally:
        ext.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        cpu_ext._set_kquant_panels(cpu_ext.kernel_config())


def test_q8_block_gemm_sums_the_dots_integers(ext, vnni):
    """Q8_0 x Q8_0 (int8 with a scale per 32 values, x rounded to int8 per 32: q8_linear's act_bits 8) from
    KernelConfig.q8_block_gemm_rows rows on: the VNNI integer GEMM (q8b_vnni_gemm), the dots' integers (x + 128 and
    the block's sum of x taken off), the dots' result up to the order of the float sums; below that row count, and
    for channel counts not a multiple of 64, the dots themselves."""
    from llmserve.model.kernels import cpu_ext

    torch.manual_seed(2)
    rows = cpu_ext.kernel_config().q8_block_gemm_rows
    try:
        for n, k in ((64, 64), (128, 576), (80, 128)):
            q, s = ops.quantize_int8_per_channel(torch.randn(n * k // 32, 32))
            q, s = q.reshape(n, k), s.reshape(n, k // 32).contiguous()
            w = (q.float().reshape(n, -1, 32) * s[..., None]).reshape(n, k)
            for m in (1, rows - 1, rows, 5, 49, 300):
                x = torch.randn(m, k) * torch.rand(m, 1) * 10
                got = ext.q8_linear(x, q, s, 1 << 62, 8)
                ext.set_q8_block_rows(1 << 62)
                dots = ext.q8_linear(x, q, s, 1 << 62, 8)
                cpu_ext._set_kquant_panels(cpu_ext.kernel_config())
                assert torch.allclose(got, dots, rtol=0, atol=2e-6 * (x.abs() @ w.abs().t()).max().item()), (n, k, m)
                if m < rows or n % 64:
                    assert torch.equal(got, dots), (n, k, m)  # the dots ran
                elif m > 1:
                    assert not torch.equal(got, dots), (n, k, m)  # the GEMM ran (its float sums differ)
    finally:
        cpu_ext._set_kquant_panels(cpu_ext.kernel_config())


def test_vnni_gemm_gives_the_integer_gemm_result_bit_for_bit(ext, vnni):
    """llmserve's own integer GEMM on int8 weights in the VNNI layout (ops.vnni_pack, q8_vnni_gemm) rounds the
    activations as q8_int_gemm does and sums the same integers (u8 = q + 128, the 128 x channel sum taken off):
    the result of _int_mm on the plain weights, bit for bit, at row counts around its 4-row blocks, channel
    counts around its 64-channel blocks, one activation level and two. The layout reads back as the weights."""
    from llmserve.config import KernelConfig

    torch.manual_seed(0)
    for n, k in ((80, 64), (300 // 16 * 16, 96), (64, 1536)):
        q, scale = ops.quantize_int8_per_channel(torch.randn(n, k))
        wv, csum = ops.vnni_pack(q)
        assert tuple(wv.shape) == (n // 16, k // 4, 16, 4) and torch.equal(csum, q.sum(1, dtype=torch.int32))
        assert torch.equal(wv.permute(0, 2, 1, 3).reshape(n, k), q)
        s = scale[:, None].contiguous()
        for m in (1, 3, 4, 5, 9, 64, 130):
            x = torch.randn(m, k) * torch.rand(m, 1) * 10
            for bits in (8, 16):
                want = ext.q8_linear(x, q, s, 1, bits)  # q8_int_gemm: _int_mm on the plain weights
                assert torch.equal(ext.q8_vnni_gemm(x, wv, csum, s, bits), want), (n, k, m, bits)
    assert ops.vnni_pack(torch.zeros(40, 64, dtype=torch.int8)) is None  # channels not a multiple of 16
    saved = ops.configure(KernelConfig(int8_vnni=False))
    try:
        assert ops.vnni_pack(q) is None
    finally:
        ops.configure(saved)


@pytest.fixture(params=["tiles", "twin"])
def amx(ext, request):
    """q8_vnni_gemm's many rows on AMX tiles (where the CPU has AMX-INT8 and Linux grants the tile state) or on the
    tiles' portable twin (any CPU the VNNI kernels or their twins run on: LLMSERVE_AMX=twin)."""
    from llmserve import envs

    ext.set_amx(True, request.param == "twin")
    if request.param == "tiles" and not ext.amx_real():
        ext.set_amx(envs.LLMSERVE_AMX != "0", envs.LLMSERVE_AMX == "twin")
        pytest.skip("no AMX-INT8 tiles here (or the VNNI twins run): the tiles' twin ('twin') is the one tested")
    assert ext.uses_amx()
    yield request.param
    ext.set_amx(envs.LLMSERVE_AMX != "0", envs.LLMSERVE_AMX == "twin")


def test_amx_tiles_sum_what_the_vnni_kernel_sums(ext, vnni, amx):
    """From 16 rows q8_vnni_gemm sums on AMX tiles (amx.h; its twin on any CPU): rows padded to tiles of 32 per level
    of rounding, chunks of rows kept in L2 (2,048 inputs x 2 levels: 256 rows a chunk, so 300 rows take two),
    16-channel blocks in pairs with an odd one last (48 channels). The sums are the VNNI kernel's integers and the
    epilogue its own: the same output bit for bit, at one level of activations and two; with K not a multiple of
    64, or under 16 rows, the VNNI kernel itself runs."""
    torch.manual_seed(3)
    for n, k in ((48, 64), (64, 2048), (80, 96), (32, 192)):
        q, scale = ops.quantize_int8_per_channel(torch.randn(n, k))
        wv, csum = ops.vnni_pack(q)
        s = scale[:, None].contiguous()
        for m in (1, 15, 16, 17, 33, 300):
            x = torch.randn(m, k) * torch.rand(m, 1) * 10
            for bits in (8, 16):
                got = ext.q8_vnni_gemm(x, wv, csum, s, bits)
                ext.set_amx(False, False)
                try:
                    want = ext.q8_vnni_gemm(x, wv, csum, s, bits)
                finally:
                    ext.set_amx(True, amx == "twin")
                assert torch.equal(got, want), (n, k, m, bits)
    ext.set_amx(False, False)
    assert not ext.uses_amx()  # LLMSERVE_AMX=0
    ext.set_amx(True, amx == "twin")
    assert ext.uses_amx() and ext.amx_real() == (amx == "tiles")


def test_int4_vnni_gemm_gives_the_dots_result(ext, vnni):
    """int4 (Q4_1 blocks) times many rows on VNNI (q4_linear from `many_rows`, KernelConfig.int4_vnni): the
    activations rounded per 32 values to int8 as the few-row dots round them, the same integer sums: the dots'
    result up to the order of the float sums, at row counts around its 4-row blocks and 256-row tasks. Off (or a
    channel count that is not a multiple of 64), many rows take the float32 tiles: the exact float32 product."""
    from llmserve.config import KernelConfig
    from llmserve.model.formats.quant import pack_int4, quantize_int4, unpack_int4

    torch.manual_seed(0)
    saved = ops.configure(KernelConfig(int4_vnni=True))
    try:
        for n, k in ((64, 64), (128, 96), (960, 576)):
            q, scale, lo = quantize_int4(torch.randn(n, k))
            qw, s, mn = pack_int4(q), scale.half().contiguous(), lo.half().contiguous()
            w = unpack_int4(qw).float().reshape(n, -1, 32) * s.float()[..., None] + mn.float()[..., None]
            w = w.reshape(n, k)
            for m in (1, 3, 4, 5, 49, 300):
                x = torch.randn(m, k) * torch.rand(m, 1) * 10
                got, dots = ext.q4_linear(x, qw, s, mn, 1), ext.q4_linear(x, qw, s, mn, 1 << 20)
                assert torch.allclose(got, dots, rtol=0, atol=2e-6 * dots.abs().max().item()), (n, k, m)
                exact = x @ w.T
                assert not torch.allclose(got, exact, rtol=0, atol=1e-5 * exact.abs().max().item())  # int8 x
                ops.configure(KernelConfig(int4_vnni=False))
                tiles = ext.q4_linear(x, qw, s, mn, 1)
                ops.configure(KernelConfig(int4_vnni=True))
                assert torch.allclose(tiles, exact, rtol=0, atol=1e-5 * exact.abs().max().item()), (n, k, m)
        q, scale, lo = quantize_int4(torch.randn(80, 64))  # 80 channels: the tiles
        qw, s, mn = pack_int4(q), scale.half().contiguous(), lo.half().contiguous()
        x = torch.randn(9, 64)
        w = (unpack_int4(qw).float().reshape(80, -1, 32) * s.float()[..., None] + mn.float()[..., None]).reshape(80, 64)
        assert torch.allclose(ext.q4_linear(x, qw, s, mn, 1), x @ w.T, rtol=0, atol=1e-4)
    finally:
        ops.configure(saved)


def test_packed_int8_weights_give_the_integer_gemm_result(ext):
    """int8 weights with a scale per channel packed in oneDNN's layout (ops.pack_weight -> pack_int8_weight, [K, N]):
    q8_linear's integer GEMM at every row count through oneDNN's u8 x s8 matmul (activations shifted by 128, zero
    point 128) sums the same integers as _int_mm on the plain weights: the same result, at one row and many, with
    one activation level and two. On auto a weight under packed_min_elements stays plain."""
    from llmserve.config import KernelConfig

    saved = ops.configure(KernelConfig(packed_weights=True))
    try:
        torch.manual_seed(0)
        w = torch.randn(300, 96)
        q, scale = ops.quantize_int8_per_channel(w)
        packed, replaces = ops.pack_weight(q)
        if not ops.cpu_has_int8_dots():  # oneDNN's u8 x s8 would saturate its int16 pair sums: never packed here
            assert (packed, replaces) == (None, False)
            pytest.skip("no VNNI / AMX on this CPU: int8 weights stay plain (exact _int_mm and dots)")
        if packed is None:
            pytest.skip("no oneDNN int8 matmul in this torch")
        assert replaces and packed.is_mkldnn and tuple(packed.shape) == (96, 300)
        s = scale[:, None].contiguous()
        for m in (1, 5, 64, 65, 130):
            x = torch.randn(m, 96)
            for bits in (8, 16):
                want = ext.q8_linear(x, q, s, 1, bits)  # _int_mm on the plain weights
                got = ext.q8_linear(x, packed, s, 1 << 30, bits)  # packed: the integer GEMM whatever many_rows says
                assert close(got, want, 1e-6), (m, bits)
                assert close(got, x @ (q.float() * s).t(), 2e-2 if bits == 8 else 1e-3)
        ops.configure(KernelConfig(packed_weights=None, packed_min_elements=300 * 96 + 1))
        assert ops.pack_weight(q) == (None, False)
        ops.configure(KernelConfig(packed_weights=True, int8_gemm=False))
        assert ops.pack_weight(q) == (None, False)
    finally:
        ops.configure(saved)


@pytest.mark.parametrize("rows,n,k", [(1, 5000, 576), (3, 1000, 64), (16, 300, 96), (2, 9, 32), (40, 700, 64)])
def test_head_argmax_is_the_argmax_of_the_float32_logits(ext, rows, n, k):
    torch.manual_seed(n + rows)
    w = torch.randn(n, k) * 0.05
    # near-ties the int8 screen cannot tell apart: rows a hair from row 0, and an exact duplicate
    w[1 : n // 2] = w[0] + 1e-6 * torch.randn(n // 2 - 1, k)
    w[n - 1] = w[0]
    x = torch.randn(rows, k) * 3
    x[0] = w[0] / w[0].norm()
    screen = ops.head_screen(w)
    got = ops.head_argmax(x, w, screen)
    logits = ext.f32_linear(x, w, 1 << 30)  # the GEMV's rounding, whatever the number of rows
    assert torch.equal(got, logits.argmax(dim=-1))  # the same token, first index on ties
    assert torch.equal(ext.head_argmax(x.t().contiguous().t(), w, *screen), got)  # strided x
    x[rows - 1, 0] = float("nan")
    assert ops.head_argmax(x, w, screen) is None  # the caller computes the logits instead
    with pytest.raises(RuntimeError):
        ext.head_argmax(x, w[:-1].contiguous(), *screen)


# group == K: per channel (one scale a row); 32: Q8_0's blocks; in between: a scale per 64 values
@pytest.mark.parametrize(
    "rows,group,k",
    [(1, 64, 64), (3, 64, 64), (6, 32, 64), (1, 32, 64), (17, 64, 64), (1, 64, 192), (2, 192, 192), (1, 32, 32)],
)
def test_q8_linear(ext, rows, group, k):
    torch.manual_seed(rows)
    q = torch.randint(-127, 128, (70, k), dtype=torch.int8)
    s = torch.rand(70, k // group) + 0.1
    ref = (q.float().view(70, -1, group) * s[..., None]).view(70, k)
    x = torch.randn(rows, k)
    for many in (1, 10**9):  # the tiled float32 path; integer dots with x rounded to int16
        assert close(ext.q8_linear(x, q, s, many, 16), x @ ref.t(), 2e-4)
    assert close(ext.q8_linear(x, q, s, 10**9, 8), x @ ref.t(), 2e-2)  # x rounded to int8


@pytest.mark.parametrize("rows", [17, 40, 129, 300])
def test_int8_gemm_rounds_activations_per_token(ext, rows):
    """Many rows on per-channel int8 weights: the integer GEMM (x rounded per row, two int8 levels for
    act_bits 16, one for 8) against the float32 tiles of the same weights; each row alone gives the same
    result as in the batch (per-token scales); off (set_q8_int_gemm(False)) the tiles run."""
    torch.manual_seed(rows)
    q = torch.randint(-127, 128, (96, 192), dtype=torch.int8)
    s = torch.rand(96, 1) + 0.1
    x = torch.randn(rows, 192) * torch.rand(rows, 1) * 10
    ref = x.double() @ (q.double() * s.double()).t()
    try:
        assert ext.set_q8_int_gemm(False) is False
        tiles = ext.q8_linear(x, q, s, 1, 16)
        assert close(tiles, ref.float(), 1e-5)
        ext.set_q8_int_gemm(True)
        two, one = ext.q8_linear(x, q, s, 1, 16), ext.q8_linear(x, q, s, 1, 8)
    finally:
        ext.set_q8_int_gemm(True)
    assert close(two, ref.float(), 1e-4) and not torch.equal(two, tiles)
    assert close(one, ref.float(), 2e-2)
    assert torch.equal(ext.q8_linear(x[5:22].contiguous(), q, s, 1, 16), two[5:22])


def test_avx512_and_avx2_int8_kernels_agree(ext, tmp_path):
    """Where the CPU has AVX-512 the int8 x int16 dots of several rows run a kernel compiled for it (8 rows a
    pass); LLMSERVE_AVX512=0 keeps the AVX2 one. Same integer dots, float sums in another order."""
    import os
    import subprocess
    import sys

    if not ext.uses_avx512():
        pytest.skip("this CPU has no AVX-512: the AVX2 kernel is the one tested above")
    torch.manual_seed(3)
    q = torch.randint(-127, 128, (300, 576), dtype=torch.int8)
    s = torch.rand(300, 1) + 0.1
    x = torch.randn(13, 576)
    torch.save((x, q, s), tmp_path / "in.pt")
    code = (
        "import sys, torch; sys.path.insert(0, '.'); from llmserve.model.kernels import ops; e = ops.cpu_kernels(); "
        f"x, q, s = torch.load('{tmp_path}/in.pt'); assert not e.uses_avx512(); "
        f"torch.save(e.q8_linear(x, q, s, 10**9, 16), '{tmp_path}/out.pt')"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "LLMSERVE_AVX512": "0"}, cwd=root)
    assert close(ext.q8_linear(x, q, s, 10**9, 16), torch.load(tmp_path / "out.pt"), 1e-6)


@pytest.fixture
def avx512_switches(ext):
    """LLMSERVE_AVX512's switches (set_avx512, set_avx512_twin) as the environment sets them, after the test."""
    from llmserve import envs

    yield ext
    ext.set_avx512(bool(envs.LLMSERVE_AVX512))
    ext.set_avx512_twin(envs.LLMSERVE_AVX512 == "twin")


def _avx512_paths(ext, x, w, q8):
    """What the AVX-512 kernels compute for x: f32_linear (the GEMV at every row count), q8_linear's int16-x dots
    for each (q, scale, _) of q8, head_argmax (its exact rows through the GEMV) where K % 32 == 0."""
    out = [ext.f32_linear(x, w, 1 << 30)]
    out += [ext.q8_linear(x, q, s, 1 << 30, 16) for q, s, _ in q8]
    if x.shape[1] % 32 == 0:
        out.append(ext.head_argmax(x, w, *ops.head_screen(w)))
    return out


def _q8_weights(n, k):
    """int8 weights with a scale per channel, per 64 values and per 32 (Q8_0's blocks): (q, scale, W in float64)."""
    if k % 32:
        return []
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    out = []
    for group in (k, 64, 32):
        if k % group == 0:
            s = torch.rand(n, k // group) + 0.1
            out.append((q, s, (q.double().reshape(n, -1, group) * s.double()[..., None]).reshape(n, k)))
    return out


def test_avx512_twins_give_the_instructions_bits(ext, avx512_switches):
    """The float32 GEMV (f32_linear, head_argmax's exact rows) and the int8 x int16 dots (q8_linear) of AVX-512 CPUs:
    their portable twins (LLMSERVE_AVX512=twin, run on every CPU) give the instructions' result bit for bit, at every
    row count of the 8-row blocks and past them, K % 32 == 16 and 0, scales per channel and per group."""
    ext.set_avx512(True)
    ext.set_avx512_twin(False)
    if not ext.avx512_real():
        pytest.skip("this CPU has no AVX-512 F/BW/DQ/VL: the twins are checked against float64 instead (below)")
    torch.manual_seed(5)
    for k in (48, 80, 64, 576):
        w, q8 = torch.randn(70, k), _q8_weights(70, k)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
            x = torch.randn(rows, k) * 3
            ext.set_avx512_twin(False)
            real = _avx512_paths(ext, x, w, q8)
            ext.set_avx512_twin(True)
            twin = _avx512_paths(ext, x, w, q8)
            assert all(torch.equal(a, b) for a, b in zip(real, twin)), (k, rows)


def test_avx512_twins_run_on_any_cpu(ext, avx512_switches):
    """set_avx512_twin(True) runs the AVX-512 kernels' twins on any CPU, even with AVX-512 off (set_avx512(False)):
    x @ W.T within float32 rounding of float64's (the int8 dots: within x's rounding to int16 per 32 values too), not
    the AVX2 kernels' bits (16 lanes summed, not 8: the twins ran); head_argmax is the argmax of their logits."""
    ext.set_avx512(False)
    assert not ext.set_avx512_twin(False) and not ext.uses_avx512()
    assert ext.set_avx512_twin(True) and ext.uses_avx512() and not ext.avx512_real()
    torch.manual_seed(6)
    for k in (48, 576):
        w, x, q8 = torch.randn(300, k), torch.randn(9, k) * 3, _q8_weights(300, k)
        twin = _avx512_paths(ext, x, w, q8)
        ext.set_avx512_twin(False)
        avx2 = _avx512_paths(ext, x, w, q8)
        ext.set_avx512_twin(True)
        xd = x.double()
        for i, wd in enumerate([w.double()] + [wd for _, _, wd in q8]):
            scale = xd.abs() @ wd.abs().t()
            bound = 1e-5 * scale
            if i > 0:  # x rounded to int16 per 32 values: each within dx / 2, dx = max|x| / 32767 of its block
                dx = xd.abs().reshape(9, -1, 32).amax(-1) / 32767
                bound = bound + 0.5 * dx @ wd.abs().reshape(300, -1, 32).sum(-1).t()
            assert ((twin[i].double() - xd @ wd.t()).abs() <= bound).all(), (k, i)
            assert ((twin[i] - avx2[i]).abs() <= 1e-5 * scale).all() and not torch.equal(twin[i], avx2[i]), (k, i)
        if k % 32 == 0:
            assert torch.equal(twin[-1], twin[0].argmax(-1))


@pytest.mark.parametrize("fp16_gemm", [True, False])
def test_quant_linear_bias_and_batch_shapes(ext, fp16_gemm):
    """Every row count through QuantLinear: the integer dots, fbgemm's float16 GEMM (with the float16
    copies) or float32 tiles (without), a bias, 3-D input."""
    torch.manual_seed(1)
    w, b = torch.randn(64, 64), torch.randn(64)
    # int4's integer dots round x to int8 per 32 values: up to ~2.3% of the largest output (200 seeds)
    for kind, tol in (("int8", 1e-3), ("int4", 4e-2)):
        lin = QuantLinear.from_float(w, b, kind, fp16_gemm=fp16_gemm)
        assert (lin._packed is not None) == fp16_gemm
        for rows in (1, 2, 6, 16, 20, 70):
            x = torch.randn(rows, 64)
            ref = F.linear(x, lin.dequantize(), b)
            k = ops.kernel_config()
            many = rows > (k.few_rows if fp16_gemm else k.int4_dot_rows if kind == "int4" else k.int8_dot_rows)
            # (int4's many rows without the float16 copies: on VNNI the integer GEMM, rounding x as the dots do)
            int4_vnni = kind == "int4" and not fp16_gemm and k.int4_vnni and ext.uses_vnni()
            assert close(lin(x), ref, 1e-3 if many and not int4_vnni else tol), (kind, rows)
        x = torch.randn(2, 3, 64)
        assert lin(x).shape == (2, 3, 64)


def test_bad_input_is_an_error_not_a_crash(ext):
    with pytest.raises(RuntimeError):
        ext.q4_linear(
            torch.randn(2, 33),
            torch.zeros(4, 16, dtype=torch.uint8),
            torch.ones(4, 1).half(),
            torch.ones(4, 1).half(),
            8,
        )
    with pytest.raises(RuntimeError):
        ext.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)


def test_w8a8_rotation_gives_the_same_product_on_every_path(ext, vnni):
    """w8a8's one-level layers rotate x by Hadamard blocks (csrc hadamard_rows, quant.rotate_rows its reference) as
    their weights were rotated at load: every kernel that takes the rotation in its act_bits code (q8_vnni_gemm while
    it rounds each row, q8_linear's dots and integer GEMM) gives the product of the rotated x, bit for bit; the layer
    gives x @ W.T at every row count and layout, and with an outlier channel its error is a fraction of the
    unrotated one's (the reason for the rotation)."""
    from llmserve.model.formats.quant import hadamard_block, rotate_rows

    torch.manual_seed(0)
    for hb in (16, 32, 64):
        x = torch.randn(5, 3 * hb)
        r = ext.hadamard_rows(x, hb)
        assert close(r, rotate_rows(x, hb), 1e-6) and close(ext.hadamard_rows(r, hb), x, 1e-6)
    with pytest.raises(RuntimeError):
        ext.hadamard_rows(torch.randn(2, 96), 64)  # 96 is not a multiple of 64
    assert [hadamard_block(k) for k in (576, 96, 48, 40)] == [64, 32, 16, 0]
    n, k, hb = 128, 192, 64
    q, scale = ops.quantize_int8_per_channel(rotate_rows(torch.randn(n, k), hb))
    wv, csum = ops.vnni_pack(q)
    s = scale[:, None].contiguous()
    for m in (1, 5, 40):
        x = torch.randn(m, k)
        xr = ext.hadamard_rows(x, hb)
        assert torch.equal(ext.q8_vnni_gemm(x, wv, csum, s, 8 | hb << 8), ext.q8_vnni_gemm(xr, wv, csum, s, 8))
        for many in (1, 1000):  # the integer GEMM, the dots
            assert torch.equal(ext.q8_linear(x, q, s, many, 8 | hb << 8), ext.q8_linear(xr, q, s, many, 8))
    w = torch.randn(256, 1536)
    per_token = {}  # the packed layer's error (x one int8 level per token at every row count), by rotation
    for rotate in (0, 64):
        lin = QuantLinear.from_float(w, None, "int8", fp16_gemm=False, hadamard=rotate)
        lin.act_bits, lin.per_token = 8, True
        lin._bind()
        assert close(lin.dequantize(), w, 1e-2)  # the weights it stands for, unrotated
        for packed in (False, True):  # the dots (x per 32 values) and integer GEMM; the VNNI layout
            if packed:
                assert lin.pack_weight()
            for rows in (1, 3, 16, 70):
                x = torch.randn(rows, 1536)
                x[:, 7] *= 50  # an outlier channel, as the SwiGLU product holds
                want = x @ w.t()
                err = ((lin(x) - want).norm() / want.norm()).item()
                assert err < (0.05 if rotate else 1), (rotate, packed, rows, err)
                if packed:
                    per_token[rotate] = max(per_token.get(rotate, 0), err)
    assert per_token[64] < 0.3 * per_token[0], per_token
