"""Speculative verification of sampled requests: rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

A draft proposed k tokens x_1..x_k, drawn from distributions q_1..q_k; one forward of the model gives its
distributions p_1..p_{k+1} at those positions (temperature, top-k, top-p and min-p applied exactly as
`sampler.sample` applies them). x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection a token is drawn from max(0, p_i - q_i), normalised, and verification stops; when all k are
accepted a bonus token is drawn from p_{k+1}. The tokens that come out are distributed exactly as if the
model had sampled them one at a time, whatever the draft proposed.

n-gram proposals (engine/ngram.py) are deterministic: q_i is a point mass on x_i, so x_i is accepted with
probability p_i(x_i) and a rejection draws from p_i without x_i. A draft model passes its q rows.
Randomness comes from the request's own generator, so a seeded request repeats itself.
"""

from __future__ import annotations

import torch

from llmserve.model.sampler import _MAX_TEMPERATURE, _draw, _filter, _filtering, _uniform
from llmserve.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax of each row's logits after its temperature, top-k, top-p and min-p: [rows, vocab] float32."""
    temps = torch.tensor([min(p.temperature, _MAX_TEMPERATURE) for p in params], device=logits.device)
    scaled = logits / temps.unsqueeze(1)
    if _filtering(params):
        scaled = _filter(scaled, params)
    return torch.softmax(scaled, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from an unnormalised probability row (through the sampler's inverse-CDF draw)."""
    u = torch.tensor([_uniform(generator)], dtype=torch.float64, device=probs.device)
    return int(_draw(torch.log(probs).unsqueeze(0), torch.ones(1, device=probs.device), u)[0])


def verify(
    probs: torch.Tensor,
    proposals: list[int],
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """probs: the model's [k + 1, vocab] distributions at the k proposals' positions and the one after
    (`target_probs`); draft_probs: the draft's [k, vocab] (None: the proposals are a point mass).
    Returns the accepted proposals followed by one token of the model's: 1 to k + 1 tokens."""
    k = len(proposals)
    assert probs.shape[0] == k + 1, (probs.shape, k)
    at = (torch.arange(k), torch.tensor(proposals, dtype=torch.long))
    p_x = probs[at].tolist() if k else []
    q_x = draft_probs[at].tolist() if draft_probs is not None and k else None
    out: list[int] = []
    for i, x in enumerate(proposals):
        q = 1.0 if q_x is None else q_x[i]
        if q <= 0.0 or _uniform(generator) * q < p_x[i]:  # accept with probability min(1, p / q)
            out.append(x)
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[x] = 0.0
        else:
            residual = (probs[i] - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing to correct, keep the proposal
            out.append(x)
            continue
        out.append(draw(residual, generator))
        return out
    out.append(draw(probs[k], generator))
    return out
