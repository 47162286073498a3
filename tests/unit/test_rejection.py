"""Rejection sampling of speculative proposals (model/rejection.py): the tokens that come out are distributed
as the model's own samples, whatever the draft proposed. Chi-square tests over many seeded draws."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.model.rejection import target_probs, verify
from llmserve.sampling_params import SamplingParams

VOCAB = 6
DRAWS = 6000


def _probs(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, VOCAB, generator=g) * 1.5, dim=-1)


def _counts(samples: list[int], size: int) -> list[int]:
    return torch.bincount(torch.tensor(samples), minlength=size).tolist()


def _assert_distributed(counts: list[int], expected: torch.Tensor) -> None:
    n = sum(counts)
    exp = (expected.double() / expected.sum() * n).tolist()
    keep = [i for i, e in enumerate(exp) if e > 0]
    assert all(counts[i] == 0 for i in range(len(exp)) if i not in keep), counts  # never an impossible token
    stat = sum((counts[i] - exp[i]) ** 2 / exp[i] for i in keep)
    assert stat < _chi2_critical(len(keep) - 1), (counts, [round(e) for e in exp], stat)


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square statistic that df degrees of freedom exceed with probability ~1e-3 (Wilson-Hilferty)."""
    if df <= 0:
        return math.inf
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


@pytest.mark.parametrize("proposals", [[2, 4], [0, 0], [5, 1]])
def test_point_mass_proposals_keep_the_model_distribution(proposals):
    """n-gram proposals: the first token is distributed as p_1, the second (given the first accepted) as p_2,
    however likely the proposals are."""
    p = _probs(1, 3)
    g = torch.Generator().manual_seed(0)
    outs = [verify(p, proposals, g) for _ in range(DRAWS)]
    assert all(1 <= len(o) <= 3 for o in outs)
    for o in outs:  # accepted proposals first, then one token that is not the rejected proposal
        k = next((i for i, (t, x) in enumerate(zip(o, proposals)) if t != x), len(o) - 1)
        assert o[:k] == proposals[:k] and len(o) == k + 1
    _assert_distributed(_counts([o[0] for o in outs], VOCAB), p[0])
    second = [o[1] for o in outs if o[0] == proposals[0]]
    _assert_distributed(_counts(second, VOCAB), p[1])


def test_draft_distribution_proposals_keep_the_model_distribution():
    """A draft model's proposals, drawn from its own q: the output is still distributed as p."""
    p, q = _probs(2, 2), _probs(3, 1)
    g, gq = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    firsts = []
    for _ in range(DRAWS):
        x = int(torch.multinomial(q[0], 1, generator=gq))
        firsts.append(verify(p, [x], g, draft_probs=q)[0])
    _assert_distributed(_counts(firsts, VOCAB), p[0])


def test_no_proposals_is_one_draw_and_certain_proposals_are_always_accepted():
    p = _probs(4, 1)
    g = torch.Generator().manual_seed(0)
    _assert_distributed(_counts([verify(p, [], g)[0] for _ in range(DRAWS)], VOCAB), p[0])
    sure = torch.zeros(3, VOCAB)
    sure[0, 3] = sure[1, 1] = sure[2, 5] = 1.0
    assert all(verify(sure, [3, 1], g) == [3, 1, 5] for _ in range(50))
    assert all(verify(sure, [2, 1], g) == [3] for _ in range(50))  # a proposal of probability 0: rejected


def test_seeded_verification_repeats_itself():
    p = _probs(5, 3)
    a = [verify(p, [1, 2], torch.Generator().manual_seed(s)) for s in range(20)]
    b = [verify(p, [1, 2], torch.Generator().manual_seed(s)) for s in range(20)]
    assert a == b


def test_target_probs_apply_temperature_and_filters_as_the_sampler():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=2), SamplingParams(top_p=0.5)]
    probs = target_probs(logits, params)
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 0.5, dim=-1))
    assert (probs[1] > 0).sum() == 2 and torch.allclose(probs[1, :2], torch.softmax(logits[1, :2], dim=-1))
    assert (probs[2] > 0).sum() == 1 and float(probs[2, 0]) == pytest.approx(1.0)
