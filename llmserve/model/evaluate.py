"""Scoring a model on a fixed text: teacher-forced logits, perplexity and greedy agreement.

Used to check quantized weights against float32 (tests/integration/test_quantization.py). Runs the model on one
sequence over a private KV cache: as a single prefill (many rows per matmul), or one token per step as decoding
does (`decode=True`: the few-rows kernels and the decode attention path).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from llmserve.model.families.llama import LlamaModel


@torch.inference_mode()
def sequence_logits(model: LlamaModel, ids: list[int], block_size: int = 16, decode: bool = False) -> torch.Tensor:
    """[len(ids), vocab] float32: the logits after each token of `ids`."""
    cfg = model.cfg
    n = len(ids)
    nb = -(-n // block_size)
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    kv = [torch.zeros(2, nb, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype) for _ in range(cfg.num_layers)]
    pos = torch.arange(n)
    if not decode:
        meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillChunk(0, n, n, torch.arange(nb))])
        return model(torch.tensor(ids), pos, kv, meta, pos).float()
    table = torch.arange(nb).unsqueeze(0)
    rows = []
    for i in range(n):
        p = pos[i : i + 1]
        meta = AttentionMetadata(slot_mapping=p, decode_groups=[DecodeGroup(0, 1, table, torch.tensor([i + 1]))])
        rows.append(model(torch.tensor(ids[i : i + 1]), p, kv, meta, torch.zeros(1, dtype=torch.long)).float())
    return torch.cat(rows)


def perplexity(model: LlamaModel, ids: list[int], decode: bool = False) -> float:
    logits = sequence_logits(model, ids, decode=decode)
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def greedy_agreement(
    model: LlamaModel, reference: LlamaModel, sequences: list[tuple[list[int], int]], decode: bool = False
) -> float:
    """Share of positions where both models' greedy next token agrees, over the last `k` tokens of each
    (ids, k) sequence (teacher-forced on the same tokens, so one disagreement does not derail the rest)."""
    same = total = 0
    for ids, k in sequences:
        a = sequence_logits(model, ids, decode=decode)[-k - 1 : -1].argmax(-1)
        b = sequence_logits(reference, ids)[-k - 1 : -1].argmax(-1)
        same += int((a == b).sum())
        total += k
    return same / total


def top_k_divergence(
    a_tokens: list[int], a_tops: list[list[int]], b_tokens: list[int], b_tops: list[list[int]], k: int = 5
) -> str | None:
    """vLLM's rule for reduced precision (its tests' `check_logprobs_close`): two greedy sequences may part after a
    near tie, but at the first position where they differ each side's token must be among the other's top `k`
    (`*_tops[i]`: the token ids ranked at position i, best first). Later positions are not compared: after a
    divergence the two continue from different contexts. None when the rule holds, else what broke it."""
    for i, (x, y) in enumerate(zip(a_tokens, b_tokens)):
        if x == y:
            continue
        missing = [
            f"{who}'s token {tok} not in the other's top-{k} {list(tops[i][:k])}"
            for who, tok, tops in (("first", x, b_tops), ("second", y, a_tops))
            if tok not in tops[i][:k]
        ]
        return f"position {i}: " + "; ".join(missing) if missing else None
    return None


def top_k_broken(a_outputs, b_outputs, k: int = 5) -> dict[int, str]:
    """`top_k_divergence` over two lists of greedy completions generated with `logprobs >= k` (CompletionOutput:
    `token_ids`, `logprobs[i].top`), pair by pair: {index: what broke the rule} for the pairs where it broke."""
    broken = {}
    for i, (a, b) in enumerate(zip(a_outputs, b_outputs)):
        tops = [[[t.token_id for t in lp.top] for lp in o.logprobs] for o in (a, b)]
        why = top_k_divergence(list(a.token_ids), tops[0], list(b.token_ids), tops[1], k=k)
        if why:
            broken[i] = why
    return broken
