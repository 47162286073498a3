"""From logits to next tokens for a whole batch: penalties, banned tokens, grammar masks, temperature,
top-k, top-p, min-p, seeds, and logprobs. Works on tensors and per-row parameter lists; knows nothing of
requests or of the engine (it imports only `llmserve.sampling_params`, and `llmserve.model.kernels.ops` for the
fused CPU draw).

Each sampled row draws its randomness from its own generator (the engine seeds it with the request's
seed, or the next seed of --seed's stream; one uniform per row, inverted through the row's cumulative
probabilities), so a seeded row gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.model.kernels import ops
from llmserve.sampling_params import Logprob, SamplingParams, TokenLogprobs


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None = None
    # tokens seen so far, for penalties: prompt and generated
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    banned_ids: list[int] = field(default_factory=list)  # e.g. EOS before min_tokens
    # A grammar that masks the logits (engine/guided.py's GuidedMatcher), or None. Duck-typed: it has
    # `fill(bitmask, row)`, which writes the allowed tokens into row `row` of an int32 bitmask
    # [rows, ceil(vocab / 32)] (bit t of the row set: token t allowed), `stop_token_ids`, and `release()`, called
    # when nothing is allowed (the row then ends on a stop token).
    guided: object | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.needs_penalties:
            continue
        out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
        counts = None
        if len(out) and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        if p.repetition_penalty != 1.0:
            recent = row.prompt_ids + row.output_ids
            recent = recent[-p.repetition_last_n :] if p.repetition_last_n else recent
            seen = torch.tensor(recent, dtype=torch.long, device=logits.device)
            mask = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            mask[seen[seen < vocab]] = True
            x = logits[i]
            logits[i] = torch.where(mask, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if counts is not None:
            logits[i] -= p.frequency_penalty * counts
            logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:  # after the penalties, as vLLM; ids past the logits (a padded vocabulary) do not occur
            ids = [t for t in p.logit_bias if t < vocab]
            bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
            logits[i, ids] += bias
    return logits


def _top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, rows: list[SamplingRow]):
    out: list[TokenLogprobs | None] = []
    want = [r.params.logprobs for r in rows]
    k = max((w for w in want if w is not None), default=None)
    if k is None:
        return [None] * len(rows)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    for i, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        top = []
        if w > 0:
            top = [Logprob(int(t), float(v)) for t, v in zip(top_ids[i, :w].tolist(), top_vals[i, :w].tolist())]
        out.append(TokenLogprobs(int(chosen[i]), float(chosen_lp[i]), top))
    return out


_MAX_TEMPERATURE = 1e30  # above it every finite logit / T is ~0 anyway: a uniform draw over the allowed tokens


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """logits: [len(rows), vocab] float32."""
    need_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None
    if any(r.params.needs_penalties for r in rows):
        logits = apply_penalties(logits.clone(), rows)
    for i, r in enumerate(rows):
        if r.banned_ids and r.guided is None:  # a guided row's ban goes with its grammar's mask
            logits[i, r.banned_ids] = float("-inf")
    if any(r.guided is not None for r in rows):
        apply_bitmask(logits, rows)  # in place; unconstrained rows untouched

    idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not idx:
        chosen = logits.argmax(dim=-1)
    else:
        sub = logits[idx] if len(idx) < len(rows) else logits
        params = [rows[i].params for i in idx]
        # (a temperature beyond float32's range would be inf there: -inf / inf is NaN)
        temps = torch.tensor([min(p.temperature, _MAX_TEMPERATURE) for p in params], device=logits.device)
        if _filtering(params):
            sub = _filter(sub / temps.unsqueeze(1), params)
            temps = torch.ones_like(temps)
        u = torch.tensor([_uniform(rows[i].generator) for i in idx], dtype=torch.float64, device=logits.device)
        picked = _draw(sub, temps, u)
        if len(idx) == len(rows):
            chosen = picked
        else:
            chosen = logits.argmax(dim=-1)
            chosen[idx] = picked
    logprobs = _top_logprobs(raw_logprobs, chosen, rows) if need_logprobs else [None] * len(rows)
    return SampleResult(chosen.tolist(), logprobs)


def _uniform(generator: torch.Generator | None) -> float:
    """One draw in [0, 1) from the row's generator (the engine gives every request one)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _draw(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draws from softmax(logits / temps) given one uniform per row: the first token whose
    cumulative probability exceeds u times the row's total (one uniform per row instead of one exponential
    per vocabulary entry: the exponential race cost ~1 ms a row for a 49k vocabulary, 40% of a 64-row
    decode step). On CPU one fused kernel (ops.sample_rows); elsewhere the same with torch ops. A token of
    probability 0 is never picked: its cumulative sum equals its predecessor's."""
    fused = ops.sample_rows(logits, temps, u)
    if fused is not None:
        return fused
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (u.clamp(max=1.0 - 2**-20).to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    zero = probs.gather(1, picked.unsqueeze(1)).squeeze(1) == 0  # only past the end, by rounding
    if bool(zero.any()):
        picked = torch.where(zero, probs.argmax(dim=-1), picked)
    return picked


def _filtering(params: list[SamplingParams]) -> bool:
    return any(p.top_k for p in params) or any(p.top_p < 1.0 for p in params) or any(p.min_p > 0 for p in params)


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, top-p and min-p, row-wise; filtered entries become -inf."""
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    vocab = logits.shape[-1]
    if any(k for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
        remove |= torch.arange(vocab, device=logits.device).unsqueeze(0) >= ks.unsqueeze(1)
        ps = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        cum = probs.cumsum(dim=-1)
        remove |= (cum - probs) >= ps.unsqueeze(1)  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    if any(m > 0 for m in min_ps):
        probs = torch.softmax(logits, dim=-1)
        mp = torch.tensor(min_ps, device=logits.device, dtype=logits.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def apply_bitmask(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: -inf on the logits of tokens the guided rows' grammars do not allow, and on their banned
    tokens. A row that this leaves with nothing allowed (its grammar is complete and EOS is banned, e.g. by
    min_tokens; or a grammar no token of this vocabulary continues, such as a regex of characters no token
    spells) gets its stop tokens back and its grammar's `release()`: the request ends there, never on a token
    the grammar refuses. The bits are unpacked
    with numpy (single-threaded, ~50 us) and applied with one
    masked_fill per guided row: few torch ops, since each costs thread start-up on a busy CPU."""
    idx = [i for i, r in enumerate(rows) if r.guided is not None]
    if not idx:
        return
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bm = torch.full((len(idx), words), -1, dtype=torch.int32)
    for j, i in enumerate(idx):
        rows[i].guided.fill(bm, j)
    bits = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    disallowed = torch.from_numpy(bits == 0).to(logits.device)
    for j, i in enumerate(idx):
        if rows[i].banned_ids:
            disallowed[j, rows[i].banned_ids] = True
        if bool(disallowed[j].all()):  # nothing left: the row ends on a stop token (the grammar releases it)
            disallowed[j, rows[i].guided.stop_token_ids] = False
            rows[i].guided.release()
        logits[i].masked_fill_(disallowed[j], float("-inf"))
