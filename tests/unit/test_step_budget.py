"""The step-time budget (--max-step-ms, llmserve/engine/step_budget.py) on a fake clock: a step with decoding rows
takes the tokens its measured cost fits in the target; a prompt alone prefills at the full token budget; the cost
model follows a machine that slows down. No model: a simulated runner advances the clock by a known cost."""

from __future__ import annotations

import pytest

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.outputs import SampledTokens
from llmserve.engine.request import Request, RequestStatus, SamplingParams
from llmserve.engine.scheduler import Scheduler, alone_token_budget
from llmserve.engine.step_budget import MIN_PREFILL, StepBudget, StepCost, resolve_max_step_ms


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Machine:
    """A scheduler whose steps cost `fixed + per_token * tokens` seconds on a fake clock."""

    def __init__(self, fixed=0.3, per_token=0.01, max_step_ms=1000.0, budget=512, after=0.0, alone=None):
        self.clock, self.fixed, self.per_token, self.after = Clock(), fixed, per_token, after
        self.kv = KVCacheManager(4096, 16, True)
        self.sched = Scheduler(
            self.kv, 64, budget, 16384, max_step_ms=max_step_ms, clock=self.clock, alone_tokens=alone
        )
        self.n = 0

    def add(self, prompt_len, max_tokens=10_000):
        self.n += 1
        r = Request(
            f"r{self.n}",
            [1 + (self.n * 7 + i) % 50 for i in range(prompt_len)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            {999},
            arrival_time=float(self.n),
        )
        self.sched.add_request(r)
        return r

    def step(self):
        out = self.sched.schedule()
        tokens = sum(out.num_scheduled_tokens.values())
        self.clock.t += self.fixed + self.per_token * tokens
        sampled = [
            SampledTokens(r, [5])
            for r in out.requests
            if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens
        ]
        self.sched.update_from_output(out, sampled)
        self.clock.t += self.after  # the engine's work after the step (detokenizing, outputs)
        return out


def _prefill_tokens(out, decoding_ids):
    return sum(n for rid, n in out.num_scheduled_tokens.items() if rid not in decoding_ids)


def test_a_prompt_beside_decoding_rows_gets_the_tokens_that_fit_the_target():
    m = Machine(fixed=0.3, per_token=0.01)  # 1000 ms target: 70 tokens a step
    streams = [m.add(20) for _ in range(8)]
    for _ in range(6):  # prefill them (one step of 160 tokens), then decode: steps of 8 and 160 tokens teach the cost
        m.step()
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in streams)
    m.add(2000)  # a long prompt arrives while 8 streams decode
    ids = {r.request_id for r in streams}
    for _ in range(5):
        out = m.step()
        assert all(out.num_scheduled_tokens.get(i) == 1 for i in ids), "every stream decodes every step"
        assert _prefill_tokens(out, ids) == 70 - 8  # (1.0 - 0.3) / 0.01 = 70 tokens, the 8 decode rows first
    assert m.sched.step_budget.cost.fixed == pytest.approx(0.3) and m.sched.step_budget.cost.per_token == pytest.approx(
        0.01
    )


def test_the_engine_work_after_a_step_counts_in_the_gap():
    """A stream waits for the whole loop, not only the model's step: the budget is fitted to the period from one
    schedule() to the next (at 8B the step alone kept the p99 gap between tokens at 1.18 s for a 1,000 ms target)."""
    m = Machine(fixed=0.3, per_token=0.01, after=0.1)
    streams = [m.add(20) for _ in range(8)]
    for _ in range(6):
        m.step()
    m.add(2000)
    ids = {r.request_id for r in streams}
    for _ in range(5):
        out = m.step()
        assert _prefill_tokens(out, ids) == 60 - 8  # (1.0 - 0.3 - 0.1) / 0.01 = 60 tokens a step
    assert m.sched.step_budget.cost.fixed == pytest.approx(0.4)


def test_a_prompt_alone_prefills_at_the_full_token_budget():
    m = Machine(fixed=0.3, per_token=0.01, budget=512)
    m.add(20)
    for _ in range(4):
        m.step()
    m.sched.finish_request("r1", RequestStatus.FINISHED_ABORTED)
    r = m.add(3000)
    out = m.step()
    assert out.num_scheduled_tokens[r.request_id] == 512  # nobody decodes: no time cap


def test_prompts_alone_take_their_own_budget_and_decoding_steps_the_chunk():
    # CPU's default: chunks of 128 beside decoding rows (their gaps), up to 2048 tokens in a step that no stream
    # waits through (each step reads every weight: a 1,000-token prompt in one step, not eight)
    assert alone_token_budget(128, "cpu", given=False) == 2048
    assert alone_token_budget(4096, "cpu", given=False) == 4096
    assert alone_token_budget(128, "cpu", given=True) == 128  # --max-num-batched-tokens given: vLLM's meaning
    assert alone_token_budget(2048, "cuda", given=False) == 2048
    m = Machine(fixed=0.3, per_token=0.01, budget=128, alone=2048)
    first = [m.add(300) for _ in range(4)]
    out = m.step()
    assert [out.num_scheduled_tokens[r.request_id] for r in first] == [300] * 4  # 1,200 tokens, one step
    late = m.add(3000)
    for _ in range(12):
        out = m.step()
        assert sum(out.num_scheduled_tokens.values()) <= 128  # four streams decode: the chunk (and the target) bound it
        assert out.num_scheduled_tokens.get(late.request_id, 0) > 0


def test_steps_of_prompts_alone_past_the_budget_are_not_fitted():
    b = StepBudget(1000.0, 128, alone_tokens=2048)
    b.observe(2048, 5.0)
    b.observe(1500, 4.0)
    assert b.cost._w == 0.0
    b.observe(128, 1.0)
    b.observe(16, 0.3)
    assert b.cost._w > 1.5


def test_decode_rows_alone_over_the_target_still_move_a_prompt():
    m = Machine(fixed=1.5, per_token=0.01, max_step_ms=1000.0)  # the fixed part alone is over the target
    streams = [m.add(30) for _ in range(4)]
    for _ in range(5):
        m.step()
    m.add(500)
    out = m.step()
    assert _prefill_tokens(out, {r.request_id for r in streams}) == MIN_PREFILL


def test_no_target_keeps_the_token_budget():
    m = Machine(max_step_ms=None, budget=256)
    streams = [m.add(20) for _ in range(4)]
    for _ in range(5):
        m.step()
    m.add(2000)
    out = m.step()
    assert _prefill_tokens(out, {r.request_id for r in streams}) == 256 - 4


def test_the_cost_follows_a_machine_that_slows_down():
    c = StepCost()
    for n in [8, 200, 8, 120, 8, 64] * 3:
        c.observe(n, 0.2 + 0.005 * n)
    assert c.tokens_within(1.0) == 160
    for n in [8, 200, 8, 120, 8, 64] * 5:  # another process takes half the CPU: every part costs twice
        c.observe(n, 2 * (0.2 + 0.005 * n))
    assert c.tokens_within(1.0) == pytest.approx(60, abs=3)


def test_steps_of_one_size_teach_nothing():
    c = StepCost()
    for _ in range(20):
        c.observe(16, 0.4)
    assert c.tokens_within(1.0) is None


def test_steps_of_one_size_follow_the_machine_speed():
    # under load every step is cut to the target's size: the spread vanishes, yet a machine that slows down (or
    # speeds up) must move the budget so that the steps come back to the target
    c = StepCost()
    for n in [8, 200, 8, 120, 8, 64] * 3:
        c.observe(n, 0.2 + 0.005 * n)
    for speed, settled in ((1.2, 126), (1.0, 160), (0.8, 207), (1.0, 160)):
        times = []
        for _ in range(40):
            n = c.tokens_within(1.0)
            times.append(speed * (0.2 + 0.005 * n))
            c.observe(n, times[-1])
        assert n == pytest.approx(settled, abs=2)
        assert max(times[-10:]) <= 1.01


def test_a_server_loaded_from_its_first_request_still_learns_the_cost():
    # 64 prompts at once: the queue never empties, so with the full token budget every step would be the same size
    # and the fit would never start (8B, 64 users: 2.4 s steps throughout); unfitted, steps with decoding rows take
    # the full budget and half of it in turn, and then the target holds
    m = Machine(fixed=0.3, per_token=0.016, max_step_ms=850.0, budget=128)
    for _ in range(64):
        m.add(158, max_tokens=64)
    periods = []
    for _ in range(60):
        t, decoding = m.clock.t, sum(1 for r in m.sched.running if r.num_tokens - r.num_computed_tokens == 1)
        m.step()
        periods.append((decoding, m.clock.t - t))
    assert m.sched.step_budget.cost.per_token == pytest.approx(0.016)
    assert m.sched.step_budget.cost.fixed == pytest.approx(0.3)
    late = [s for d, s in periods[10:] if d]
    assert late and max(late) <= 0.85 + 1e-9


def test_defaults_by_device():
    assert resolve_max_step_ms(None, "cpu") == 850.0
    assert resolve_max_step_ms(None, "cuda") is None
    assert resolve_max_step_ms(0, "cpu") is None
    assert resolve_max_step_ms(250, "cuda") == 250


def test_debug_logging_shows_each_step_as_the_budget_sees_it(caplog):
    """`--log-level debug`: one line per step with its tokens, its time and the whole period, what the fit predicted
    for it (or "unfitted" before the fit is known), and the queue: what found the budget's start-under-load bug."""
    import logging

    m = Machine(fixed=0.3, per_token=0.01)
    for _ in range(4):
        m.add(300)
    with caplog.at_level(logging.DEBUG, logger="llmserve.scheduler"):
        for _ in range(12):
            m.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step: ")]
    assert len(lines) == 11  # (a step's cost is read when the next one is scheduled)
    assert lines[0] == (  # two 300-token prompts in the first 512 tokens: one started, one whole; two waiting
        "step: 512 tokens, 5.420 s, period 5.420 s (predicted unfitted); running 2, waiting 2, preemptions 0"
    )
    assert "predicted unfitted" in lines[1]
    assert lines[-1] == (
        "step: 4 tokens, 0.340 s, period 0.340 s (predicted 0.340 s); running 4, waiting 0, preemptions 0"
    )
