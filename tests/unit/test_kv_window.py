"""The sliding-window layers' block group (engine/kv_window.py) with the real Scheduler and KVCacheManager,
no model: the window layers' blocks are written and read as the runner does (their own ids, positions from the
first held block), so the tests check that every position a query still reads holds its own token, that the
blocks a window has passed go back, that a prefix hit is shortened where the window's blocks were evicted,
and that nothing leaks through preemption, aborts and speculative rollbacks."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kv_scheduler_properties import Sim

from llmserve.engine.kv_plan import split_kv_blocks
from llmserve.engine.kv_window import WindowGroup
from llmserve.engine.outputs import SchedulerOutput
from llmserve.engine.request import RequestStatus


class WindowSim(Sim):
    def __init__(self, num_blocks, block_size, max_seqs, budget, caching, window, window_blocks=None, **kw):
        group = WindowGroup(0, block_size, window, caching)
        need = group.blocks_per_sequence(min(budget, num_blocks * block_size))
        group = WindowGroup(window_blocks or need, block_size, window, caching)
        super().__init__(num_blocks, block_size, max_seqs, budget, caching, window=group, **kw)
        self.wslots: dict[tuple[int, int], int] = {}
        self.window = window
        self.most_held = 0

    def write(self, r, c, tokens):
        super().write(r, c, tokens)
        first, ids = self.kv.window.table(r.request_id)
        assert first * self.bs <= max(0, c - self.window + 1), "a block the step reads was given back"
        assert (first + len(ids)) * self.bs >= c + len(tokens)
        for pos, token in zip(range(c, c + len(tokens)), tokens):
            self.wslots[(ids[pos // self.bs - first], pos % self.bs)] = token
        held = self.kv.window.num_blocks - self.kv.window.pool.num_free
        self.most_held = max(self.most_held, held)

    def check_contents(self):
        super().check_contents()
        for r in self.sched.running:  # the positions the next query reads
            first, ids = self.kv.window.table(r.request_id)
            for pos in range(max(0, r.num_computed_tokens - self.window + 1), r.num_computed_tokens):
                key = (ids[pos // self.bs - first], pos % self.bs)
                assert self.wslots.get(key) == r.all_token_ids[pos], (r, pos)

    def check_pool(self):
        super().check_pool()
        group = self.kv.window
        held = {}
        for blocks in group.req_blocks.values():
            for b in blocks:
                if b is not None:
                    held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in group.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0), b
        free_ids = [b.block_id for b in group.pool.free_queue]
        assert len(free_ids) == len(set(free_ids)) == group.pool.num_free

    def run(self, rng, steps=5000):
        for _ in range(steps):
            if not self.sched.has_unfinished():
                return
            self.step(rng)
            self.check_pool()
        raise AssertionError("requests did not finish")


ops = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "step", "abort", "preempt"]), st.integers(0, 10_000)),
    min_size=1,
    max_size=100,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    window=st.integers(1, 20),
    extra=st.integers(0, 12),
    max_seqs=st.integers(1, 5),
    budget=st.integers(1, 32),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    spec=st.sampled_from([0, 0, 3]),
)
def test_random_interleavings_keep_the_window_and_leak_nothing(
    ops, num_blocks, block_size, window, extra, max_seqs, budget, caching, policy, spec
):
    probe = WindowGroup(0, block_size, window, caching)
    need = probe.blocks_per_sequence(min(budget, num_blocks * block_size))
    sim = WindowSim(num_blocks, block_size, max_seqs, budget, caching, window, need + extra, policy=policy, spec=spec)
    rng = random.Random(0)
    docs = [[random.Random(d).randrange(50) for _ in range(60)] for d in range(3)]
    for op, x in ops:
        if op == "add":
            plen = 1 + (x // 7) % max(1, min(60, sim.max_model_len - 2))
            prompt = docs[x % 3][:plen] if x % 4 else [(x * 7 + i) % 50 for i in range(plen)]
            sim.add(prompt, 1 + x % 20, priority=x % 3)
        elif op == "step":
            sim.step(rng)
        elif op == "abort" and sim.sched.requests:
            rid = sorted(sim.sched.requests)[x % len(sim.sched.requests)]
            sim.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        elif op == "preempt" and sim.sched.running:
            sim.sched._preempt(sim.sched.running[x % len(sim.sched.running)], SchedulerOutput())
        sim.check_pool()
    sim.run(rng)
    assert sim.kv.num_free_blocks == num_blocks
    assert sim.kv.window.pool.num_free == sim.kv.window.num_blocks
    assert sim.kv.usage == 0.0


def test_a_long_sequence_holds_what_its_window_costs():
    """One request far longer than its window: the window group's free count goes back up as the window
    passes blocks, and the group never holds more than the window plus a step's chunk."""
    sim = WindowSim(num_blocks=64, block_size=4, max_seqs=1, budget=8, caching=True, window=10)
    group = sim.kv.window
    sim.add([i % 50 for i in range(150)], 60)
    rng = random.Random(1)
    free = []
    while sim.sched.has_unfinished():
        sim.step(rng)
        sim.check_pool()
        free.append(group.pool.num_free)
    assert any(b > a for a, b in zip(free, free[1:])), "no block given back"
    assert sim.most_held <= group.blocks_per_sequence(8) < 210 // 4  # the full layers hold 53 blocks
    assert sim.kv.num_free_blocks == 64 and group.pool.num_free == group.num_blocks


def test_prefix_hit_needs_the_windows_blocks():
    """A repeated prompt hits its full-attention blocks; the hit counts only as far as the window layers still
    hold the blocks of the last window before it: after those are evicted, the hit is shortened."""
    sim = WindowSim(num_blocks=64, block_size=4, max_seqs=1, budget=64, caching=True, window=6, window_blocks=20)
    rng = random.Random(2)
    prompt = [i % 50 for i in range(41)]
    sim.add(prompt, 1)
    sim.run(rng)
    again = sim.add(prompt, 1)  # everything still cached (passed window blocks keep their names)
    sim.run(rng)
    assert again.num_cached_tokens == 40
    for base in (100, 200):  # other prompts evict the window pool's cached blocks (the full pool keeps its own)
        sim.add([base + i for i in range(60)], 1)
        sim.run(rng)
    third = sim.add(prompt, 1)
    sim.run(rng)
    hashes = third.block_hashes
    assert all(sim.kv.pool.get_cached(h) is not None for h in hashes[:10])  # the full layers' blocks: all there
    assert third.num_cached_tokens < 40
    h = third.num_cached_tokens // 4  # and what is used has its window's blocks
    first = sim.kv.window.first_needed(h * 4)
    assert h == 0 or all(sim.kv.window.pool.get_cached(x) is not None for x in hashes[first:h])


def test_preemption_when_the_window_pool_is_full():
    """The window pool holds one sequence: a second one waits or is preempted, never fails, and both finish
    with every block back."""
    sim = WindowSim(num_blocks=64, block_size=2, max_seqs=4, budget=4, caching=False, window=5)
    reqs = [sim.add(list(range(i, i + 9)), 12) for i in range(3)]
    sim.run(random.Random(3))
    assert all(r.is_finished for r in reqs)
    assert sim.sched.num_preemptions > 0
    assert sim.kv.window.pool.num_free == sim.kv.window.num_blocks and sim.kv.num_free_blocks == 64


def test_budget_split_in_proportion_to_need():
    # Gemma-style 1:5 over 6 layers, sequences of 64 blocks, 10 of them in a window: bytes split 64:50
    nf, nw = split_kv_blocks(100, [True] * 5 + [False], 64, 10, 10_000)
    assert nf + 5 * nw <= 600 and nf > 300 and nw >= 10
    assert abs(nf / nw - 6.4) < 0.2
    # all layers windowed: the full pool is bookkeeping only, large enough for the window pool's sequences
    nf, nw = split_kv_blocks(100, [True] * 4, 64, 10, 10_000)
    assert nw == 100 and nf == 640
