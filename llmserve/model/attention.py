"""Paged attention over a block pool, in plain PyTorch (SDPA).

The KV cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for keys and the same
for values. A request's keys live in the blocks its block table names; a token at position `p` sits in
slot `block_table[p // block_size] * block_size + p % block_size`. An int8 cache (--kv-cache-dtype int8)
is `[..., num_kv_heads, head_dim + 4]`: each token's head row is its values rounded to int8 with one
scale (max |x| / 127, symmetric), whose float32 bytes follow the values (`quantize_kv`): a block stays
one self-contained run of bytes, and the kernels read the scale beside the row they dequantize.

One flat batch holds decode tokens first (one query each, batched together) and then prefill chunks
(several queries each, attended one chunk at a time, against the cached prefix plus themselves). On CPU
both read the blocks in place through the C++ kernels (ops.paged_decode_attention,
ops.paged_prefill_attention, sliding windows and sinks included); elsewhere, and for soft-capped layers, blocks are
gathered for SDPA (written out where there are sinks: gpt-oss's learned logit per query head that joins each
softmax's denominator, as transformers' eager attention adds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmserve.model.kernels import ops


@dataclass
class PrefillChunk:
    query_start: int  # row of the chunk's first token in the flat batch
    query_len: int
    context_len: int  # tokens of this request in the cache after this step (prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_of_request] int64
    # position runs [start, end) whose tokens attend to each other both ways (a Gemma 3 image), in this chunk
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass
class DecodeGroup:
    """Decode rows [start, end): one query each, against context_lens[i] cached keys."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, max_blocks]
    context_lens: torch.Tensor  # [rows] int64
    _mask: torch.Tensor | None = None

    def mask(self, block_size: int) -> torch.Tensor:
        """[rows, 1, 1, max_blocks * block_size]: True where a key exists (for the SDPA path, which
        reads every padded position)."""
        if self._mask is None:
            width = self.block_tables.shape[1] * block_size
            m = torch.arange(width, device=self.context_lens.device).unsqueeze(0) < self.context_lens.unsqueeze(1)
            self._mask = m[:, None, None, :]
        return self._mask


@dataclass
class StateMetadata:
    """A step's sequences for the recurrent layers of a hybrid model (engine/state_pool.py), in batch order: the
    first `num_decodes` have one row each (rows 0 .. num_decodes - 1), the others a chunk of rows."""

    slots: torch.Tensor  # [num_seqs] int64: each sequence's slot in the layers' state tensors
    slot_list: list[int]  # the same, as ints
    query_start: list[int]  # each sequence's first row in the flat batch
    query_len: list[int]
    fresh: torch.Tensor  # [num_seqs] bool: its state starts at zero (its first chunk; the slot is zeroed already)
    num_decodes: int = 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # the sliding-window layers' own (their blocks in a pool of their own, engine/kv_window.py), or None:
    # they read this one. Their positions there start at their first held block (shifted down).
    window: "AttentionMetadata | None" = None
    states: StateMetadata | None = None  # a hybrid model's recurrent layers' sequences and slots


KV_SCALE_BYTES = 4  # an int8 cache row's float32 scale, after its head_dim values
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (stored unscaled, as vLLM's uncalibrated fp8 KV)


def kv_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one token's head in a cache of `kv_dtype` (its last dimension)."""
    return head_dim + KV_SCALE_BYTES if kv_dtype is torch.int8 else head_dim


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype):
    """One layer's cache: keys and values, [2, num_blocks, block_size, num_kv_heads, row width]."""
    return (2, num_blocks, block_size, num_kv_heads, kv_row_width(head_dim, kv_dtype))


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> int8 rows [..., D + 4]: round(x / s) with s = max|x| / 127 per row (0 for a row of
    zeros), then s's float32 bytes. The C++ writer (csrc quantize_kv_row) computes the same bits."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 4] (quantize_kv) -> [..., D] in `dtype`: each value times its row's scale."""
    d = rows.shape[-1] - KV_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def _stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New keys or values [T, Hkv, D] as `cache` stores them (as bytes for float8: index_copy_ has no float8)."""
    if cache.dtype is torch.int8:
        return quantize_kv(x)
    if cache.is_floating_point() and cache.element_size() == 1:  # float8_e4m3fn: saturated, not NaN
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(cache.dtype).view(torch.uint8)
    return x.to(cache.dtype)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    nkv, w = k_cache.shape[-2:]
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = _stored(x, cache)
        flat = cache.view(-1, nkv, w) if rows.dtype == cache.dtype else cache.view(rows.dtype).view(-1, nkv, w)
        flat.index_copy_(0, slot_mapping, rows)


_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _buffer(slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A persistent scratch buffer (per slot, dtype and device), grown as needed. Gathering into
    reused memory avoids mapping fresh pages for every layer of every step."""
    key = (slot, like.dtype, like.device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 20), dtype=like.dtype, device=like.device)
        _WORKSPACE[key] = buf
    return buf[:numel]


def _gather(cache: torch.Tensor, block_table: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., max_blocks] block ids -> [..., num_kv_heads, max_blocks * block_size, head_dim], in `dtype`
    (the queries'; a cache stored narrower, --kv-cache-dtype, is widened here, an int8 one dequantized).

    One index_select of whole blocks (each a contiguous run of block_size * heads * dim values),
    several times faster on CPU than advanced indexing with a 2-D index."""
    if cache.is_floating_point() and cache.element_size() == 1:  # float8: moved as bytes
        return _gather(cache.view(torch.uint8), block_table, slot, torch.uint8).view(cache.dtype).to(dtype)
    nb, bs, nkv, d = cache.shape
    idx = block_table.reshape(-1)
    out = _buffer(slot, idx.numel() * bs * nkv * d, cache).view(idx.numel(), bs * nkv * d)
    torch.index_select(cache.view(nb, bs * nkv * d), 0, idx, out=out)
    g = out.view(*block_table.shape[:-1], block_table.shape[-1] * bs, nkv, d)
    if cache.dtype is torch.int8 and dtype is not torch.int8:
        return dequantize_kv(g, dtype).transpose(-3, -2)
    return g.transpose(-3, -2).to(dtype)


# prompt tokens from which a bfloat16 model's chunk without a cached prefix attends in bfloat16 (paged_attention):
# SDPA in bfloat16 against the float32 kernel, 3B heads (24 x 128, 8 KV): 0.88 vs 0.97 ms at 128 tokens, 14.3 vs
# 27.1 ms at 1,000 (equal at 64)
BF16_PREFILL_MIN = 128


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    bf16_prefill: bool = False,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens (already in the cache when kv_written).
    Returns [T, H, D]. `window`: a sliding-window layer, whose queries see only the last `window`
    positions (the kernels read only those; elsewhere a mask), over the blocks `meta` gives it: all of them, or
    from the first one inside the window with the engine's window group; `softcap`: attention logits ->
    tanh(s / cap) * cap (the gather + mask path); `sinks` [H]: a logit per query head in every softmax's
    denominator, no value. `bf16_prefill` (a model of bfloat16 weights, whose o_proj rounds these rows to bfloat16
    anyway): a chunk of at least BF16_PREFILL_MIN tokens with no cached prefix attends in bfloat16 through SDPA
    (oneDNN/AMX), as vLLM's CPU build attends; elsewhere float32."""
    if not kv_written:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    plain = window is None and softcap is None
    if sinks is not None:
        sinks = sinks.float().contiguous()
    for g in meta.decode_groups:
        if softcap is None and ops.paged_decode_attention(
            out[g.start : g.end],
            q[g.start : g.end],
            k_cache,
            v_cache,
            g.block_tables,
            g.context_lens,
            scale,
            sinks=sinks,
            window=window,
        ):
            continue  # read in place from the blocks (the fused CPU kernel)
        kd = _gather(k_cache, g.block_tables, 0, q.dtype)  # [B, Hkv, L, D]
        vd = _gather(v_cache, g.block_tables, 1, q.dtype)
        qd = q[g.start : g.end].unsqueeze(2)  # [B, H, 1, D]
        mask = g.mask(k_cache.shape[1])
        if window is not None:
            first = (g.context_lens - window).view(-1, 1, 1, 1)
            mask = mask & (torch.arange(mask.shape[-1], device=q.device) >= first)
        out[g.start : g.end] = _attend(qd, kd, vd, mask, scale, softcap, sinks).squeeze(2)
    for chunk in meta.prefills:
        s, n, ctx = chunk.query_start, chunk.query_len, chunk.context_len
        if bf16_prefill and ctx == n >= BF16_PREFILL_MIN and plain and sinks is None and not chunk.bidirectional:
            qp, kp, vp = (t[s : s + n].transpose(0, 1).unsqueeze(0).to(torch.bfloat16) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
            out[s : s + n] = o.squeeze(0).transpose(0, 1)
            continue
        if (
            softcap is None
            and not chunk.bidirectional
            and ops.paged_prefill_attention(
                out[s : s + n], q[s : s + n], k_cache, v_cache, chunk.block_table, ctx, scale, sinks, window
            )
        ):
            continue  # read in place from the blocks, prefix and chunk alike (the flash-style CPU kernel)
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if ctx == n:  # no cached prefix: the chunk attends to itself, causally
            kp = k[s : s + n].transpose(0, 1).unsqueeze(0)
            vp = v[s : s + n].transpose(0, 1).unsqueeze(0)
        else:
            kp = _gather(k_cache, chunk.block_table, 2, q.dtype)[:, :ctx].unsqueeze(0)
            vp = _gather(v_cache, chunk.block_table, 3, q.dtype)[:, :ctx].unsqueeze(0)
        if ctx == n and plain and sinks is None and not chunk.bidirectional:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
            key_pos = torch.arange(ctx, device=q.device).unsqueeze(0)
            mask = key_pos <= q_pos  # [n, ctx]
            if window is not None:
                mask = mask & (key_pos > q_pos - window)
            for a, b in chunk.bidirectional:  # the run sees itself whole
                mask = mask | ((q_pos >= a) & (q_pos < b) & (key_pos >= a) & (key_pos < b))
            o = _attend(qp, kp, vp, mask, scale, softcap, sinks)
        out[s : s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over q [B, H, n, D], k and v [B, Hkv, L, D] where `mask` is True; with `softcap` or `sinks` [H]
    (float32), the same written out (SDPA has neither), as transformers' eager attention computes it: the sink
    joins each row's logits as one more column (its max taken with the rest) and is dropped after the softmax."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
    s = torch.cat([s.float(), sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s - s.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(p.to(q.dtype), v)
