"""Prompt log-probabilities (SamplingParams.prompt_logprobs), computed in the prefill.

The runner asks the model for the final-normed hidden states of every prompt position of a chunk of a
request that wants them (`rows`), as it does for pooling requests; `record` turns them into float32 logits
with the model's own head (`forward_head`: the exact logits, never the greedy screen), takes their
log_softmax and keeps, for the prompt token that follows each position, its logprob, its rank and the
top-N. Position p's logits score prompt token p + 1, so the last prompt position scores nothing here (its
logits are the first sampled token's). The entries accumulate on the request across chunks; a request
recomputed after preemption starts again at position 0, and so do they.
"""

from __future__ import annotations

import torch

from llmserve.engine.request import Logprob, Request, TokenLogprobs

SLICE = 256  # rows of logits at a time: [256, vocab] float32 is ~50 MB for a 49k vocabulary


def rows(request: Request, start: int, n: int) -> int:
    """How many of a chunk's `n` positions from `start` score a prompt token (0: the request wants none)."""
    if not request.needs_prompt_logprobs or request.params.pooling is not None:
        return 0
    return max(0, min(start + n, request.num_prompt_tokens - 1) - start)


@torch.inference_mode()
def record(model, request: Request, start: int, hidden: torch.Tensor) -> None:
    """Score prompt tokens start + 1 .. start + len(hidden) from the hidden states of positions start.. ."""
    del request.prompt_logprobs[start:]  # a chunk recomputed (after preemption) replaces what it scored
    k = request.params.prompt_logprobs or 0
    targets = request.prompt_token_ids[start + 1 : start + 1 + hidden.shape[0]]
    for i in range(0, len(targets), SLICE):
        logprobs = torch.log_softmax(model.forward_head(hidden[i : i + SLICE]).float(), dim=-1)
        request.prompt_logprobs.extend(score(logprobs, targets[i : i + SLICE], k))


def score(logprobs: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Per row of `logprobs` ([rows, vocab]): the target token's logprob, its 1-based rank, the top `k`."""
    t = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, t.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    out = []
    for j, token in enumerate(targets):
        top = [Logprob(a, v, rank=r + 1) for r, (a, v) in enumerate(zip(ids[j], vals[j]))] if k > 0 else []
        out.append(TokenLogprobs(token, chosen[j], top, rank=ranks[j]))
    return out
