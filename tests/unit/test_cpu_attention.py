"""The C++ kernels of norms, activations, rotary and paged attention (csrc/norms.cpp, attention_decode.cpp,
attention_prefill.cpp) against their PyTorch references; the linear kernels are in test_cpu_ops.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve import envs
from llmserve.model.attention import dequantize_kv, kv_row_width, quantize_kv
from llmserve.model.kernels import ops
from llmserve.model.layers.rotary import _rotate

CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def close(a, b, rel=1e-5):
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-6)


def _stored(x, dtype):
    """Keys or values [..., D] as a cache of `dtype` holds them (int8: rows with their scale)."""
    return quantize_kv(x) if dtype is torch.int8 else x.to(dtype)


def _widened(cache):
    """A cache's stored values as float32 [..., D]: what the kernels must read."""
    return dequantize_kv(cache, torch.float32) if cache.dtype is torch.int8 else cache.float()


def test_norms(ext):
    x, r, w = torch.randn(5, 72), torch.randn(5, 72), torch.randn(72)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert close(ext.rms_norm(x, w, 1e-5), ref)
    x2, r2 = x.clone(), r.clone()
    ext.add_rms_norm_(x2, r2, w, 1e-6)
    s = x + r
    assert close(r2, s) and close(x2, w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)))


def test_silu_and_mul(ext):
    gu = torch.randn(3, 2 * 48) * 6
    g, u = gu.chunk(2, -1)
    assert close(ext.silu_and_mul(gu), F.silu(g) * u, 1e-6)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_and_kv_written(ext, head_dim, cache_dtype):
    T, H, Hk, D = 5, 4, 2, head_dim
    qkv = torch.randn(T, (H + 2 * Hk) * D)
    pos = torch.tensor([0, 3, 9, 31, 2])
    slots = torch.tensor([7, 0, 33, 12, 5])
    half = torch.randn(40, D // 2)
    cos, sin = torch.cat([half.cos(), half.cos()], -1), torch.cat([half.sin(), half.sin()], -1)
    q, k = qkv[:, : H * D].view(T, H, D), qkv[:, H * D : (H + Hk) * D].view(T, Hk, D)
    rq, rk = _rotate(q, cos[pos][:, None], sin[pos][:, None]), _rotate(k, cos[pos][:, None], sin[pos][:, None])
    v = qkv[:, (H + Hk) * D :].clone()
    W = kv_row_width(D, cache_dtype)
    kc, vc = torch.zeros(3, 16, Hk, W, dtype=cache_dtype), torch.zeros(3, 16, Hk, W, dtype=cache_dtype)
    ext.rotary_write_kv_(qkv, pos, cos, sin, H, Hk, D, kc, vc, slots)
    assert close(qkv[:, : H * D].view(T, H, D), rq) and close(qkv[:, H * D : (H + Hk) * D].view(T, Hk, D), rk)
    assert torch.equal(qkv[:, (H + Hk) * D :], v)
    # the cache holds the rotated keys and the values, rounded as torch rounds to its dtype (float16:
    # to nearest, ties to even; int8: the same bits as attention.quantize_kv, scales included)
    written_k = _stored(qkv[:, H * D : (H + Hk) * D].view(T, Hk, D), cache_dtype)
    assert torch.equal(kc.view(-1, Hk, W)[slots], written_k)
    assert torch.equal(vc.view(-1, Hk, W)[slots], _stored(v.view(T, Hk, D), cache_dtype))
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False
    assert kc.view(-1, Hk, W)[untouched].abs().sum() == 0
    with pytest.raises(RuntimeError):  # a slot outside the cache is refused, not written
        ext.rotary_write_kv_(qkv, pos, cos, sin, H, Hk, D, kc, vc, torch.tensor([7, 0, 48, 12, 5]))


def test_bfloat16_cache_rows_round_as_torch_rounds(ext):
    # values written through the kernel into a bfloat16 cache: the same bits as torch's .to(torch.bfloat16) (to
    # nearest, ties to even, in integer AVX2 on every CPU), at the ties, the largest finite values and infinities;
    # a NaN stays a NaN (torch's own paths differ in its bits); the values pass the rotary untouched (V rows)
    T, H, Hk, D = 4, 1, 1, 64
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000]
        + [0x00008000, 0x80018000, 0x00000001, 0x3F800001, 0xBF7FFFFF, 0x47EFFFFF, 0x00000000],
        dtype=torch.int64,
    )
    special = torch.tensor(bits.to(torch.int32).tolist(), dtype=torch.int32).view(torch.float32)
    qkv = torch.randn(T, (H + 2 * Hk) * D)
    qkv[:, (H + Hk) * D :] = torch.cat([special, torch.randn(T * D - special.numel())]).view(T, D)
    cos, sin = torch.ones(8, D), torch.zeros(8, D)
    kc, vc = torch.zeros(1, 16, Hk, D, dtype=torch.bfloat16), torch.zeros(1, 16, Hk, D, dtype=torch.bfloat16)
    ext.rotary_write_kv_(qkv, torch.arange(T), cos, sin, H, Hk, D, kc, vc, torch.arange(T))
    want = qkv[:, (H + Hk) * D :].to(torch.bfloat16)
    got = vc.view(-1, D)[:T]
    nan = want.isnan()
    assert nan.sum() == 1 and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_decode_attention(ext, head_dim, cache_dtype, avx512):
    """Decode attention read in place from shuffled blocks against SDPA over the stored values widened (the PyTorch
    path's own arithmetic: the portable twin), with LLMSERVE_AVX512's switch either way: the kernel has one (AVX2)
    variant today, so both settings must give the same bits; a wider variant added later is held to the same bound."""
    if avx512 and not ext.uses_avx512():
        pytest.skip("this CPU has no AVX-512: the AVX2 kernel is the one tested (the setting below)")
    ext.set_avx512(avx512)
    try:
        _check_decode_attention(ext, head_dim, cache_dtype)
    finally:
        ext.set_avx512(bool(envs.LLMSERVE_AVX512))


def test_paged_decode_attention_isa_settings_agree_on_int8_blocks(ext):
    """On the same int8 blocks, the decode kernel with AVX-512 allowed and with it off agree within 1e-5 (each is held
    to the widened reference above too). Today both settings run the one AVX2 kernel, so they are equal; where the
    CPU lacks AVX-512 both settings run the AVX2 kernel."""
    torch.manual_seed(1)
    B, H, Hk, D, NB, BS = 3, 8, 2, 64, 24, 16
    kc = _stored(torch.randn(NB, BS, Hk, D) * torch.rand(NB, BS, Hk, 1) * 4, torch.int8)
    vc = _stored(torch.randn(NB, BS, Hk, D), torch.int8)
    tables = torch.stack([torch.randperm(NB)[:8] for _ in range(B)])
    lens = torch.tensor([5, 77, 128])
    q = torch.randn(B, H, D)
    outs = []
    for wide in (True, False):
        ext.set_avx512(wide)
        try:
            out = torch.zeros(B, H, D)
            ext.paged_decode_attention_(out, q, kc, vc, tables, lens, 0.125)
            outs.append(out)
        finally:
            ext.set_avx512(bool(envs.LLMSERVE_AVX512))
    assert close(outs[0], outs[1], 1e-5)


def _check_decode_attention(ext, head_dim, cache_dtype):
    torch.manual_seed(0)
    B, H, Hk, D, NB, BS = 4, 6, 2, head_dim, 40, 16
    kc, vc = _stored(torch.randn(NB, BS, Hk, D), cache_dtype), _stored(torch.randn(NB, BS, Hk, D), cache_dtype)
    lens = torch.tensor([1, 17, 100, 33])
    tables = torch.stack([torch.randperm(NB)[:7] for _ in range(B)])
    if cache_dtype is torch.int8:  # rows of many scales, a key and a value of zeros (scale 0) that are read
        kc = _stored(torch.randn(NB, BS, Hk, D) * torch.rand(NB, BS, Hk, 1) * 4, cache_dtype)
        kc[tables[2, 1], 5, 1] = vc[tables[2, 3], 0, 0] = quantize_kv(torch.zeros(D))
    qkv = torch.randn(B, (H + 2) * D)  # strided query rows, as the model passes them
    q = qkv[:, : H * D].view(B, H, D)
    out = torch.zeros(B, H, D)
    ext.paged_decode_attention_(out, q, kc, vc, tables, lens, 0.1)
    for b in range(B):
        n = int(lens[b])
        k = _widened(kc[tables[b]]).reshape(-1, Hk, D)[:n].transpose(0, 1)[None]  # the stored values, widened
        v = _widened(vc[tables[b]]).reshape(-1, Hk, D)[:n].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[b][None, :, None], k, v, scale=0.1, enable_gqa=True)[0, :, 0]
        assert close(out[b], ref, 1e-5)
    bad = tables.clone()
    bad[2, 3] = NB  # a block id outside the cache is refused, not read
    with pytest.raises(RuntimeError):
        ext.paged_decode_attention_(out, q, kc, vc, bad, lens, 0.1)
    with pytest.raises(RuntimeError):  # keys and values of different types are refused
        ext.paged_decode_attention_(out, q, kc, vc.double(), tables, lens, 0.1)


def _prefill_reference(q, kc, vc, table, ctx, scale):
    """float64 causal SDPA of q [n, H, D] (positions ctx - n .. ctx - 1) over the first ctx stored keys."""
    n, _, d = q.shape
    hk = kc.shape[2]
    k = _widened(kc[table]).reshape(-1, hk, d)[:ctx].double().transpose(0, 1)[None]
    v = _widened(vc[table]).reshape(-1, hk, d)[:ctx].double().transpose(0, 1)[None]
    mask = torch.arange(ctx)[None] <= torch.arange(ctx - n, ctx)[:, None]
    qd = q.double().transpose(0, 1)[None]
    return F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("groups", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_prefill_attention(ext, head_dim, groups, cache_dtype, avx512):
    """A prefill chunk's attention read in place from shuffled blocks against float64 SDPA: fresh chunks and
    chunks after a prefix (inside one block, across several, not a multiple of the block size), chunk lengths
    1 to 300 (partial query and key tiles, the diagonal tile), strided query rows, both ISA variants."""
    if avx512 and not ext.uses_avx512():
        pytest.skip("this CPU has no AVX-512")
    torch.manual_seed(head_dim + groups)
    Hk, D, NB, BS = 2, head_dim, 48, 16
    H = Hk * groups
    kc = _stored(torch.randn(NB, BS, Hk, D), cache_dtype)
    vc = _stored(torch.randn(NB, BS, Hk, D), cache_dtype)
    ext.set_avx512(avx512)
    try:
        for prefix, n in [(0, 1), (0, 7), (0, 64), (0, 300), (5, 1), (13, 7), (16, 64), (50, 300), (100, 33)]:
            ctx = prefix + n
            table = torch.randperm(NB)[: (ctx + BS - 1) // BS]
            qkv = torch.randn(n, (H + 2 * Hk) * D)  # query rows strided, as the model passes them
            q = qkv[:, : H * D].view(n, H, D)
            out = torch.full((n, H, D), float("nan"))
            ext.paged_prefill_attention_(out, q, kc, vc, table, ctx, 0.125)
            ref = _prefill_reference(q, kc, vc, table, ctx, 0.125)
            assert close(out.double(), ref, 1e-5), (prefix, n)
    finally:
        ext.set_avx512(bool(envs.LLMSERVE_AVX512))
    bad = table.clone()
    bad[-1] = NB  # a block id outside the cache is refused, not read
    with pytest.raises(RuntimeError):
        ext.paged_prefill_attention_(out, q, kc, vc, bad, ctx, 0.125)
    with pytest.raises(RuntimeError):  # a table too short for the context
        ext.paged_prefill_attention_(out, q, kc, vc, table[:-1], ctx, 0.125)


def test_prefill_attention_avx512_twin_gives_the_instructions_bits(ext):
    """The prefill kernel's AVX-512 variant and its portable twin, the AVX2 variant (LLMSERVE_AVX512=twin or 0 runs
    it): the rows lie in the vector lanes, so both make each row's float operations in the same order and give the
    same bits, for every cache type and head size, with and without sinks and a window."""
    try:
        ext.set_avx512(True)
        ext.set_avx512_twin(False)
        if not ext.avx512_real():
            pytest.skip("this CPU has no AVX-512 F/BW/DQ/VL: its twin, the AVX2 variant, is the one tested above")
        torch.manual_seed(7)
        NB, BS, Hk = 48, 16, 2
        for cache_dtype in CACHE_DTYPES:
            for D, groups in ((64, 1), (128, 3), (64, 4)):
                H = Hk * groups
                kc = _stored(torch.randn(NB, BS, Hk, D) * 3, cache_dtype)
                vc = _stored(torch.randn(NB, BS, Hk, D), cache_dtype)
                gpt_oss = dict(sinks=torch.randn(H) * 3, window=24)
                for prefix, n, extra in [(0, 1, {}), (0, 300, {}), (13, 7, {}), (50, 100, {}), (40, 90, gpt_oss)]:
                    ctx = prefix + n
                    table = torch.randperm(NB)[: (ctx + BS - 1) // BS]
                    q = torch.randn(n, H, D) * 2
                    outs = []
                    for twin in (False, True):
                        ext.set_avx512_twin(twin)
                        out = torch.full((n, H, D), float("nan"))
                        ext.paged_prefill_attention_(out, q, kc, vc, table, ctx, 0.125, **extra)
                        outs.append(out)
                    assert torch.equal(outs[0], outs[1]), (cache_dtype, D, groups, prefix, n)
    finally:
        ext.set_avx512(bool(envs.LLMSERVE_AVX512))
        ext.set_avx512_twin(envs.LLMSERVE_AVX512 == "twin")


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_paged_attention_prefill_kernel_and_sdpa_paths_agree(ext, cache_dtype, gpt_oss):
    """attention.paged_attention on a step of decode rows and two prefill chunks (one fresh, one after a
    cached prefix): the in-place prefill kernel and the SDPA path (KernelConfig(in_place_prefill=False)) give
    the same rows; head sizes the kernel lacks fall back by themselves. An int8 cache: the Python writer and
    dequantizer (write_kv, the gather) and the kernels read the same stored values; only the fresh chunk, which
    the SDPA path attends with its own unrounded keys, differs by the rounding. gpt-oss's layers: sinks and a
    sliding window shorter than the prefix (the written-out softmax against the kernels)."""
    from llmserve.config import KernelConfig
    from llmserve.model.attention import (
        AttentionMetadata,
        DecodeGroup,
        PrefillChunk,
        kv_cache_shape,
        paged_attention,
        write_kv,
    )

    torch.manual_seed(1)
    H, Hk, D, NB, BS = 6, 2, 64, 32, 16
    kv = torch.zeros(kv_cache_shape(NB, BS, Hk, D, cache_dtype), dtype=cache_dtype)
    tables = [torch.randperm(NB)[:6], torch.randperm(NB)[:6]]
    # request 0: 40 cached tokens, a 9-token chunk; request 1: a fresh 21-token prompt; then one decode row
    prefix = torch.randn(40, Hk, D), torch.randn(40, Hk, D)
    pos0 = torch.arange(40)
    write_kv(kv[0], kv[1], *prefix, tables[0][pos0 // BS] * BS + pos0 % BS)
    pos = torch.cat([torch.tensor([39]), torch.arange(40, 49), torch.arange(21)])
    owner = [0] + [0] * 9 + [1] * 21
    slots = torch.stack([tables[r][p // BS] * BS + p % BS for r, p in zip(owner, pos.tolist())])
    T = len(owner)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hk, D), torch.randn(T, Hk, D)
    meta = AttentionMetadata(
        slot_mapping=slots,
        decode_groups=[DecodeGroup(0, 1, tables[0][None], torch.tensor([40]))],
        prefills=[PrefillChunk(1, 9, 49, tables[0]), PrefillChunk(10, 21, 21, tables[1])],
    )
    k[0], v[0] = prefix[0][39], prefix[1][39]  # the decode row rewrites the prefix's last slot unchanged
    extra = dict(sinks=torch.randn(H) * 2, window=24) if gpt_oss else {}
    saved = ops.configure(KernelConfig(in_place_prefill=False, in_place_decode=False))
    try:  # as the engine runs it (the gather's scratch buffers are inference tensors)
        with torch.inference_mode():
            slow = paged_attention(q, k, v, kv[0], kv[1], meta, 0.125, **extra)
    finally:
        ops.configure(saved)
    with torch.inference_mode():
        fast = paged_attention(q, k, v, kv[0], kv[1], meta, 0.125, kv_written=True, **extra)
    assert close(fast[:10], slow[:10], 1e-5)  # the decode row and the chunk after the prefix
    assert close(fast[10:], slow[10:], 1e-5 if cache_dtype is torch.float32 else 0.05)
    out = torch.empty(5, H, 96)
    assert not ops.paged_prefill_attention(out, torch.randn(5, H, 96), kv[0], kv[1], tables[1], 5, 0.1)


def test_a_bf16_models_long_fresh_chunk_attends_in_bfloat16():
    """bf16_prefill (a model of bfloat16 weights): a chunk of BF16_PREFILL_MIN tokens or more with no cached prefix
    attends in bfloat16 through SDPA, exactly torch's SDPA over the rows rounded to bfloat16; a shorter chunk and one
    after a cached prefix keep the float32 path's rows bit for bit."""
    from llmserve.model.attention import (
        BF16_PREFILL_MIN,
        AttentionMetadata,
        PrefillChunk,
        kv_cache_shape,
        paged_attention,
    )

    torch.manual_seed(2)
    H, Hk, D, NB, BS = 4, 2, 64, 48, 16
    long = BF16_PREFILL_MIN + 19
    kv = torch.zeros(kv_cache_shape(NB, BS, Hk, D, torch.float32))
    table = torch.randperm(NB)
    t0, t1, t2 = table[:19], table[19:21], table[21:26]  # a long fresh prompt, a short one, a chunk after 40 cached
    chunks = [(t0, 0, long), (t1, 0, 21), (t2, 40, 70)]
    slots = torch.cat([tb[p // BS] * BS + p % BS for tb, a, b in chunks for p in [torch.arange(a, b)]])
    T = len(slots)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hk, D), torch.randn(T, Hk, D)
    pre = torch.arange(40)
    kv[0].view(-1, Hk, D)[t2[pre // BS] * BS + pre % BS] = torch.randn(40, Hk, D)
    kv[1].view(-1, Hk, D)[t2[pre // BS] * BS + pre % BS] = torch.randn(40, Hk, D)
    n0 = long
    meta = AttentionMetadata(
        slot_mapping=slots,
        prefills=[PrefillChunk(0, n0, long, t0), PrefillChunk(n0, 21, 21, t1), PrefillChunk(n0 + 21, 30, 70, t2)],
    )
    with torch.inference_mode():
        f32 = paged_attention(q, k, v, kv[0], kv[1], meta, 0.125)
        bf = paged_attention(q, k, v, kv[0], kv[1], meta, 0.125, bf16_prefill=True)
    assert torch.equal(bf[n0:], f32[n0:])
    want = F.scaled_dot_product_attention(
        *(t[:n0].transpose(0, 1).unsqueeze(0).to(torch.bfloat16) for t in (q, k, v)),
        is_causal=True,
        scale=0.125,
        enable_gqa=True,
    )
    assert torch.equal(bf[:n0], want.squeeze(0).transpose(0, 1).float())
    assert not torch.equal(bf[:n0], f32[:n0]) and close(bf[:n0], f32[:n0], 0.03)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_8_bit_caches_written_and_gathered_by_the_pytorch_path(cache_dtype):
    """The PyTorch side of the 8-bit caches (the path of CUDA and of shapes the kernels lack): write_kv stores
    int8 rows within half a step of their scale (max |x| / 127 per token and head; zeros stay zeros) and fp8
    values saturated at +-448 instead of NaN; the gather reads back exactly what was stored."""
    from llmserve.model.attention import FP8_MAX, _gather, kv_cache_shape, write_kv

    torch.manual_seed(3)
    NB, BS, Hk, D = 6, 16, 2, 64
    kv = torch.zeros(kv_cache_shape(NB, BS, Hk, D, cache_dtype), dtype=cache_dtype)
    k = torch.randn(20, Hk, D) * torch.rand(20, Hk, 1) * 8
    v = torch.randn(20, Hk, D)
    k[3, 1] = 0.0
    k[4, 0, 5] = 1000.0  # beyond float8's range
    table = torch.tensor([4, 1])
    slots = table[torch.arange(20) // BS] * BS + torch.arange(20) % BS
    write_kv(kv[0], kv[1], k, v, slots)
    with torch.inference_mode():
        gk = _gather(kv[0], table, 0, torch.float32)[:, :20].transpose(0, 1)  # [20, Hk, D]
        gv = _gather(kv[1], table, 1, torch.float32)[:, :20].transpose(0, 1)
    if cache_dtype is torch.int8:
        step = k.abs().amax(-1, keepdim=True) / 127
        assert ((gk - k).abs() <= step / 2 + 1e-6).all()
        assert torch.equal(gk, dequantize_kv(quantize_kv(k), torch.float32))
        assert torch.equal(gv, dequantize_kv(quantize_kv(v), torch.float32))
        assert (gk[3, 1] == 0).all()
    else:
        assert torch.isfinite(gk).all() and gk[4, 0, 5] == FP8_MAX
        assert torch.equal(gv, v.to(cache_dtype).float())
        assert ((gk - k).abs() <= k.abs() / 16 + 1e-2)[k.abs() < FP8_MAX].all()  # e4m3: 3 mantissa bits


def _written_out(q, k, v, q_pos, scale, sinks=None, window=None):
    """float64 attention of q [n, H, D] at positions q_pos over keys / values [L, Hk, D] (positions 0 .. L - 1),
    causal, within the last `window` positions, with gpt-oss's sinks [H] in each softmax's denominator."""
    n, H, _ = q.shape
    k, v = k.double().repeat_interleave(H // k.shape[1], 1), v.double().repeat_interleave(H // v.shape[1], 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    key = torch.arange(k.shape[0])[None]
    mask = key <= q_pos[:, None]
    if window is not None:
        mask &= key > q_pos[:, None] - window
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(H, n, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hnl,lhd->nhd", p, v)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_decode_attention_sinks_and_window(ext, head_dim, cache_dtype):
    """gpt-oss's decode: sinks (large and small against the scores) and a sliding window (shorter and longer than
    the context); the blocks wholly before a row's window are never read (their table entries invalid here)."""
    torch.manual_seed(2)
    B, H, Hk, D, NB, BS = 4, 8, 2, head_dim, 40, 16
    kc, vc = _stored(torch.randn(NB, BS, Hk, D), cache_dtype), _stored(torch.randn(NB, BS, Hk, D), cache_dtype)
    lens = torch.tensor([1, 17, 100, 40])
    q = torch.randn(B, H, D)
    sinks = torch.tensor([-20.0, 0.0, 1.0, 3.0, 8.0, -1.0, 0.5, 30.0])
    for window in (None, 1, 24, 200):
        tables = torch.stack([torch.randperm(NB)[:7] for _ in range(B)])
        if window is not None:
            for b in range(B):
                tables[b, : max(0, int(lens[b]) - window) // BS] = -1
        out = torch.zeros(B, H, D)
        ext.paged_decode_attention_(out, q, kc, vc, tables, lens, 0.125, sinks, window or 0)
        for b in range(B):
            n = int(lens[b])
            rows = tables[b].clamp(min=0)
            k = _widened(kc[rows]).reshape(-1, Hk, D)[:n]
            v = _widened(vc[rows]).reshape(-1, Hk, D)[:n]
            ref = _written_out(q[b][None], k, v, torch.tensor([n - 1]), 0.125, sinks, window)[0]
            assert close(out[b].double(), ref, 1e-5), (window, b)
    with pytest.raises(RuntimeError):  # one sink per query head
        ext.paged_decode_attention_(out, q, kc, vc, tables.clamp(min=0), lens, 0.125, sinks[:4], 0)


@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_prefill_attention_sinks_and_window(ext, head_dim, groups, avx512):
    """gpt-oss's prefill: sinks and sliding windows (1, shorter than a key tile, longer than the context) over
    fresh chunks and chunks after a prefix, both ISA variants (the window and the sinks are applied outside the
    vector code: the same for both); blocks before the first query's window are never read."""
    if avx512 and not ext.uses_avx512():
        pytest.skip("this CPU has no AVX-512")
    torch.manual_seed(head_dim + groups)
    Hk, D, NB, BS = 2, head_dim, 48, 16
    H = Hk * groups
    kc, vc = torch.randn(NB, BS, Hk, D), torch.randn(NB, BS, Hk, D)
    sinks = torch.randn(H) * 3
    ext.set_avx512(avx512)
    try:
        for window in (None, 1, 24, 128, 1000):
            for prefix, n in [(0, 1), (0, 40), (0, 300), (13, 7), (50, 300), (100, 33), (200, 1)]:
                ctx = prefix + n
                table = torch.randperm(NB)[: (ctx + BS - 1) // BS]
                keys = _widened(kc[table]).reshape(-1, Hk, D)[:ctx]
                values = _widened(vc[table]).reshape(-1, Hk, D)[:ctx]
                if window is not None:
                    table[: max(0, prefix - window + 1) // BS] = -1
                qkv = torch.randn(n, (H + 2 * Hk) * D)
                q = qkv[:, : H * D].view(n, H, D)
                out = torch.full((n, H, D), float("nan"))
                ext.paged_prefill_attention_(out, q, kc, vc, table, ctx, 0.125, sinks, window or 0)
                ref = _written_out(q, keys, values, torch.arange(prefix, ctx), 0.125, sinks, window)
                assert close(out.double(), ref, 1e-5), (window, prefix, n)
    finally:
        ext.set_avx512(bool(envs.LLMSERVE_AVX512))
