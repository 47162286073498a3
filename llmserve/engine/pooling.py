"""Embeddings (SamplingParams.pooling): a pooling request's final hidden states -> one normalized vector.

The runner hands each step's hidden states of a pooling request's positions to `pool`. Their running sum
lives on the request (`Request.pooled_sum`), so a prompt prefilled in chunks pools as if in one piece; a
request recomputed after preemption starts again at position 0, and so does its sum. When the whole prompt
is computed the vector goes to the scheduler in `SampledTokens.embedding`, which finishes the request.
"""

from __future__ import annotations

import torch

from llmserve.engine.request import Request


def pool(request: Request, hidden: torch.Tensor, start: int) -> list[float] | None:
    """Add this step's final hidden states ([rows, hidden], positions `start`..) to the request's sum. Once
    they reach the end of its prompt: its normalized vector (the mean, or the last position), else None."""
    total = hidden.float().sum(0)
    request.pooled_sum = total if start == 0 else request.pooled_sum + total
    if start + hidden.shape[0] < request.num_tokens:
        return None
    vec = request.pooled_sum / request.num_tokens if request.params.pooling == "mean" else hidden[-1].float()
    request.pooled_sum = None
    return torch.nn.functional.normalize(vec, dim=0).tolist()
