"""The recurrent state pool of hybrid models (engine/state_pool.py) with the real Scheduler and KVCacheManager, no
model: the simulated runner keeps in each slot the tokens its sequence has run through (what a recurrent state
summarises), starting it over where the step says the state is fresh. So the tests check that a slot is never
shared, that a sequence's state carries across chunks and steps and starts over after preemption, and that every
slot comes back through finishes, aborts and preemptions."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kv_scheduler_properties import Sim, ops

from llmserve.config import EngineConfig
from llmserve.engine.outputs import SchedulerOutput
from llmserve.engine.request import RequestStatus
from llmserve.engine.state_pool import StatePool, hybrid_config
from llmserve.model.config import ModelConfig


class StateSim(Sim):
    def __init__(self, num_blocks, block_size, max_seqs, budget, slots, **kw):
        super().__init__(num_blocks, block_size, max_seqs, budget, False, states=StatePool(slots), **kw)
        self.state: dict[int, list[int]] = {}  # slot -> the tokens its sequence has run through

    def write(self, r, c, tokens):
        super().write(r, c, tokens)
        slot = self.kv.states.slot(r.request_id)
        if c == 0:  # fresh: the runner zeroes the slot
            self.state[slot] = []
        assert self.state[slot] == r.all_token_ids[:c], "a slot's state is not its sequence's"
        self.state[slot] = self.state[slot] + list(tokens)

    def check_pool(self):
        super().check_pool()
        pool = self.kv.states
        held = list(pool.slot_of.values())
        assert len(held) == len(set(held)), "a slot is shared"
        assert set(pool.slot_of) == {r.request_id for r in self.sched.running}
        assert pool.num_free + len(held) == pool.num_slots
        assert set(held).isdisjoint(pool._free)

    def run(self, rng, steps=5000):
        for _ in range(steps):
            if not self.sched.has_unfinished():
                return
            self.step(rng)
            self.check_pool()
        raise AssertionError("requests did not finish")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_seqs=st.integers(1, 6),
    slots=st.integers(1, 6),
    budget=st.integers(1, 32),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_interleavings_never_share_or_leak_a_slot(ops, num_blocks, block_size, max_seqs, slots, budget, policy):
    sim = StateSim(num_blocks, block_size, max_seqs, budget, min(slots, max_seqs), policy=policy)
    rng = random.Random(0)
    for op, x in ops:
        if op == "add":
            plen = 1 + (x // 7) % max(1, min(40, sim.max_model_len - 2))
            sim.add([(x * 7 + i) % 50 for i in range(plen)], 1 + x % 12, priority=x % 3)
        elif op == "step":
            sim.step(rng)
        elif op in ("abort", "finish") and sim.sched.requests:
            rid = sorted(sim.sched.requests)[x % len(sim.sched.requests)]
            status = RequestStatus.FINISHED_ABORTED if op == "abort" else RequestStatus.FINISHED_STOPPED
            sim.sched.finish_request(rid, status)
        elif op == "preempt" and sim.sched.running:
            sim.sched._preempt(sim.sched.running[x % len(sim.sched.running)], SchedulerOutput())
        sim.check_pool()
    sim.run(rng)
    assert sim.kv.states.num_free == sim.kv.states.num_slots
    assert sim.kv.num_free_blocks == num_blocks


def test_fewer_slots_than_sequences_wait_not_fail():
    """Two slots, four requests: two run, the others wait for a slot (not for blocks) and all finish."""
    sim = StateSim(num_blocks=64, block_size=4, max_seqs=4, budget=64, slots=2)
    reqs = [sim.add(list(range(i, i + 6)), 5) for i in range(4)]
    out = sim.step(random.Random(1))
    assert len(out.requests) == 2 and sim.sched.num_waiting == 2
    sim.run(random.Random(1))
    assert all(r.is_finished for r in reqs) and sim.kv.states.num_free == 2


def test_preempted_sequence_starts_its_state_over():
    """Preemption frees the slot; the sequence is recomputed from its tokens in a fresh slot (the sim checks the
    state holds exactly the tokens run through since)."""
    sim = StateSim(num_blocks=5, block_size=4, max_seqs=3, budget=8, slots=3)
    reqs = [sim.add(list(range(i * 10, i * 10 + 7)), 8) for i in range(3)]
    sim.run(random.Random(2))
    assert sim.sched.num_preemptions > 0
    assert all(r.is_finished for r in reqs) and sim.kv.states.num_free == 3


def _hybrid() -> ModelConfig:
    return ModelConfig(
        "Lfm2ForCausalLM", 100, 64, 128, 3, 4, 2, 16, 1e-5, 1e4, 128, True, recurrent_layers=(True, False, True)
    )


def test_hybrid_config_turns_prefix_caching_off_and_refuses_what_the_state_cannot_follow(caplog):
    config = EngineConfig()
    with caplog.at_level("INFO", logger="llmserve.engine"):
        got = hybrid_config(config, _hybrid())
    assert not got.enable_prefix_caching and config.enable_prefix_caching  # (the caller's config is left alone)
    assert "prefix caching off" in caplog.text
    plain = dataclasses.replace(_hybrid(), recurrent_layers=())
    assert hybrid_config(config, plain) is config
    for kw, what in (
        (dict(speculative_ngram=3), "speculative decoding"),
        (dict(speculative_model="x"), "speculative decoding"),
        (dict(tensor_parallel_size=2), "tensor parallelism"),
        (dict(enable_lora=True), "LoRA"),
        (dict(kv_cache_dir="/tmp/kv"), "disk KV tier"),
    ):
        with pytest.raises(ValueError, match=what):
            hybrid_config(EngineConfig(**kw), _hybrid())


def test_kv_bytes_count_attention_layers_only():
    import torch

    from llmserve.engine.kv_plan import RecurrentState, bytes_per_block, config_kinds

    def per_block(mc):
        return bytes_per_block(config_kinds(mc, mc.num_kv_heads, torch.float32), 16)

    hybrid = _hybrid()
    plain = dataclasses.replace(hybrid, recurrent_layers=())
    assert per_block(hybrid) * 3 == per_block(plain)
    pool = StatePool(4, [((2, 64),), None, ((2, 64),)])
    assert RecurrentState(((2, 64),), torch.float32).slot_bytes() == 2 * 64 * 4
    assert [t.shape for t in pool.tensors(0, torch.float32, torch.device("cpu"))] == [(4, 2, 64)]
