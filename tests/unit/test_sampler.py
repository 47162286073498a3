"""The sampler without a model: hand-made logits through `sample` (temperature, top-k, top-p, min-p,
penalties, seeds, banned tokens, grammar masks, logprobs)."""

from __future__ import annotations

import ast
import math
import pathlib
from collections import Counter

import pytest
import torch

from llmserve.model.sampler import SamplingRow, apply_penalties, sample
from llmserve.sampling_params import SamplingParams

# probabilities 0.5, 0.3, 0.15, 0.05
LOGITS = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)])


def draw(params: SamplingParams, n: int = 2000, logits: torch.Tensor = LOGITS, seed: int = 0) -> Counter:
    """How often each token is drawn in n independent rows."""
    torch.manual_seed(seed)
    rows = [SamplingRow(params) for _ in range(n)]
    return Counter(sample(logits.repeat(n, 1), rows).token_ids)


def test_greedy_is_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert sample(logits, [SamplingRow(SamplingParams(temperature=0))] * 2).token_ids == [1, 0]


def test_temperature_follows_the_softmax():
    freq = draw(SamplingParams(temperature=1.0))
    for t, p in enumerate((0.5, 0.3, 0.15, 0.05)):
        assert abs(freq[t] / 2000 - p) < 0.04, freq
    sharp = draw(SamplingParams(temperature=0.25))  # p^4, renormalised: token 0 ~ 0.88
    assert sharp[0] / 2000 > 0.8 and set(sharp) <= {0, 1, 2, 3}


def test_top_k_top_p_min_p_filter():
    assert set(draw(SamplingParams(top_k=2))) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.7))) == {0, 1}  # 0.5 + 0.3 is the smallest set >= 0.7
    assert set(draw(SamplingParams(top_p=0.85))) == {0, 1, 2}
    assert set(draw(SamplingParams(min_p=0.2))) == {0, 1, 2}  # p >= 0.2 * 0.5
    assert set(draw(SamplingParams(min_p=0.5))) == {0, 1}
    assert set(draw(SamplingParams(top_k=3, top_p=0.7, min_p=0.01))) == {0, 1}


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    assert apply_penalties(logits.clone(), [row]).tolist() == [[1.0, -4.0, 1.0, 0.5]]  # seen: 0 and 1
    # repetition_last_n (Ollama's repeat_last_n): only the last N tokens count; the prompt's 0 is out of reach
    row = SamplingRow(SamplingParams(repetition_penalty=2.0, repetition_last_n=2), prompt_ids=[0], output_ids=[2, 1])
    assert apply_penalties(logits.clone(), [row]).tolist() == [[2.0, -4.0, 0.5, 0.5]]
    with pytest.raises(ValueError, match="repetition_last_n"):
        SamplingParams(repetition_last_n=0)
    row = SamplingRow(
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt_ids=[3], output_ids=[2, 2, 0]
    )
    # the prompt does not count for frequency and presence penalties
    assert apply_penalties(logits.clone(), [row]).tolist() == [[1.25, -2.0, -0.25, 0.5]]
    # a strong enough penalty changes the greedy pick
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=2.0), output_ids=[0, 0])
    assert sample(logits.clone(), [row]).token_ids == [2]


def test_seeded_rows_repeat_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=7)

    def seeded():
        g = torch.Generator()
        g.manual_seed(7)
        return SamplingRow(params, g)

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    alone = [sample(logits.clone(), [row]).token_ids[0] for row in [seeded()] for _ in range(8)]
    row = seeded()
    others = SamplingRow(SamplingParams(temperature=0.8))
    batch = torch.cat([torch.randn(3, 50), logits, torch.randn(2, 50)])
    in_batch = [sample(batch.clone(), [others] * 3 + [row] + [others] * 2).token_ids[3] for _ in range(8)]
    assert in_batch == alone and len(set(alone)) > 1


def test_banned_ids_are_never_drawn():
    greedy = SamplingRow(SamplingParams(temperature=0), banned_ids=[0, 1])
    assert sample(LOGITS.unsqueeze(0).clone(), [greedy]).token_ids == [2]
    torch.manual_seed(0)
    rows = [SamplingRow(SamplingParams(), banned_ids=[0])] * 500
    assert set(sample(LOGITS.repeat(500, 1), rows).token_ids) == {1, 2, 3}


def test_logprobs_shapes_and_values():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    rows = [
        SamplingRow(SamplingParams(temperature=0, logprobs=3)),
        SamplingRow(SamplingParams(temperature=0, logprobs=0)),
        SamplingRow(SamplingParams(temperature=0)),
    ]
    res = sample(logits.clone(), rows)
    full = torch.log_softmax(logits, dim=-1)
    a, b, c = res.logprobs
    assert (a.token_id, len(a.top), [t.token_id for t in a.top]) == (1, 3, [1, 2, 0])
    assert math.isclose(a.logprob, full[0, 1].item(), rel_tol=1e-6)
    assert all(math.isclose(t.logprob, full[0, t.token_id].item(), rel_tol=1e-6) for t in a.top)
    assert (b.token_id, b.top) == (2, []) and c is None
    assert sample(logits.clone(), [rows[2]] * 3).logprobs == [None] * 3


def test_logprobs_are_of_the_raw_logits():
    """Penalties and bans change the pick, not the logprobs reported for it (as vLLM's default)."""
    row = SamplingRow(SamplingParams(temperature=0, logprobs=1), banned_ids=[0])
    res = sample(LOGITS.unsqueeze(0).clone(), [row])
    assert res.token_ids == [1] and math.isclose(res.logprobs[0].logprob, math.log(0.3), rel_tol=1e-6)
    assert res.logprobs[0].top[0].token_id == 0


class OnlyToken:
    """A grammar (duck-typed, as engine/guided.py's GuidedMatcher) that allows one token."""

    def __init__(self, token: int, stop_token_ids=(3,)) -> None:
        self.token, self.stop_token_ids = token, list(stop_token_ids)
        self.released = False

    def release(self) -> None:
        self.released = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        if self.token is not None:
            bitmask[row, self.token // 32] = 1 << (self.token % 32)


def test_grammar_mask_leaves_other_rows_alone():
    rows = [SamplingRow(SamplingParams(temperature=0), guided=OnlyToken(2)), SamplingRow(SamplingParams(temperature=0))]
    assert sample(LOGITS.repeat(2, 1), rows).token_ids == [2, 0]
    torch.manual_seed(0)
    rows = [SamplingRow(SamplingParams(), guided=OnlyToken(2))] * 200
    assert set(sample(LOGITS.repeat(200, 1), rows).token_ids) == {2}


def test_complete_grammar_with_eos_banned_ends_with_eos():
    """docs/structured-output.md: once the grammar is complete only EOS is allowed; if EOS is also banned
    (min_tokens), EOS wins."""
    done = SamplingRow(SamplingParams(temperature=0), banned_ids=[3], guided=OnlyToken(None))
    assert sample(LOGITS.unsqueeze(0).clone(), [done]).token_ids == [3]


def test_the_sampler_does_not_import_the_engine():
    src = pathlib.Path(__file__).parents[2] / "llmserve" / "model" / "sampler.py"
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(ast.parse(src.read_text()))
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    ]
    assert not [m for m in imported if m and m.startswith("llmserve.engine")], imported


def test_fused_draw_matches_the_torch_draw():
    """ops.sample_rows (the CPU kernel) picks the token the torch ops pick for the same uniforms, over a
    large vocabulary with a ragged tail, filtered (-inf) entries and mixed temperatures; -inf is never drawn."""
    from llmserve.model import sampler
    from llmserve.model.kernels import ops

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 49157, generator=gen) * 3
    logits[:, ::7] = float("-inf")
    temps = torch.rand(64, generator=gen) * 1.5 + 0.2
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2**-40
    fused = ops.sample_rows(logits, temps, u)
    if fused is None:
        return  # no extension on this machine: the torch path is the only one
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp(max=49156)
    assert (fused == expected).float().mean() > 0.95, (fused != expected).nonzero()
    # where they differ, rounding: the target lies at the edge of the fused pick's interval of the CDF
    hi = cdf.gather(1, fused.unsqueeze(1)).squeeze(1)
    lo = hi - probs.double().gather(1, fused.unsqueeze(1)).squeeze(1)
    target = u * cdf[:, -1]
    assert bool(((target >= lo - 1e-5) & (target <= hi + 1e-5)).all())
    assert bool(torch.isfinite(logits.gather(1, fused.unsqueeze(1))).all())
    assert (sampler._draw(logits[:4], temps[:4], u[:4]) == fused[:4]).all()


def test_values_beyond_float32_never_pick_a_masked_token():
    """A temperature that is finite in Python but inf in float32 (1e300) must not turn the logits to NaN, which
    drew token 0 past the grammar's mask (a 500 found by the fuzz test)."""
    extremes = [
        {"temperature": 1e300},
        {"temperature": 1e300, "min_p": 1.0},
        {"temperature": 1e300, "top_k": 5, "repetition_penalty": 10.0},
    ]
    for kw in extremes:
        for seed in range(5):
            logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(seed)) * 5
            logits[0, 0] = 0.0  # (a zero times an infinite factor is NaN)
            row = SamplingRow(
                SamplingParams(**kw), torch.Generator().manual_seed(seed), [3, 4, 0], [3, 0], [], OnlyToken(7)
            )
            assert sample(logits, [row]).token_ids == [7], kw


def test_grammar_no_token_continues_ends_on_a_stop_token():
    """A grammar that this vocabulary cannot continue (a regex of characters no token spells) allows nothing:
    the row draws a stop token and the grammar is released (the request ends), never a refused token."""
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0)):
        g = OnlyToken(None)
        assert sample(LOGITS.repeat(1, 1), [SamplingRow(params, guided=g)]).token_ids == [3] and g.released


def test_logit_bias_bans_and_forces_tokens():
    banned = SamplingParams(temperature=0, logit_bias={"0": -100})
    assert sample(LOGITS.repeat(1, 1), [SamplingRow(banned)]).token_ids == [1]  # the argmax moves on
    forced = draw(SamplingParams(temperature=1.0, logit_bias={3: 100}), n=500)
    assert forced == Counter({3: 500})
    never = draw(SamplingParams(temperature=1.0, logit_bias={"0": -100, "1": -100}), n=1000)
    assert set(never) == {2, 3} and abs(never[2] / 1000 - 0.75) < 0.06, never  # 0.15 : 0.05, renormalised
    # a bias shifts the distribution as softmax says: +ln(3) on token 3 makes it as likely as token 2
    shifted = draw(SamplingParams(temperature=1.0, logit_bias={3: math.log(3)}))
    assert abs(shifted[3] - shifted[2]) / 2000 < 0.04, shifted


def test_logit_bias_is_checked():
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={"5": 1}).needs_penalties
    for bad in ({"x": 1}, {"-1": 1}, {"5": 101}, {"5": float("nan")}, {"5": "1"}, [5]):
        try:
            SamplingParams(logit_bias=bad)
        except ValueError as e:
            assert "logit_bias" in str(e)
        else:
            raise AssertionError(f"accepted {bad!r}")
