"""Property-based tests of the block manager and scheduler alone (no model, no tensors).

A simulated engine drives Scheduler + KVCacheManager through random interleavings of add, step,
finish, abort and forced preemption. Its "runner" writes each scheduled token into its block's slot
and samples random tokens; the real `Scheduler.update_from_output` appends them, stops requests and
rolls back rejected speculative proposals. So the test can check that every computed position of every
running request reads its own token: a block is never shared between requests whose contents differ,
and a rollback never leaves a rejected proposal inside the computed prefix.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.outputs import SampledTokens, SchedulerOutput
from llmserve.engine.request import Request, RequestStatus, SamplingParams
from llmserve.engine.scheduler import QueueFullError, Scheduler


class Sim:
    def __init__(
        self, num_blocks, block_size, max_seqs, budget, caching, policy="fcfs", max_queued=None, spec=0, **parts
    ):
        """`parts`: the KV cache manager's window group or state pool."""
        self.kv = KVCacheManager(num_blocks, block_size, caching, **parts)
        self.max_model_len = num_blocks * block_size
        self.sched = Scheduler(self.kv, max_seqs, budget, self.max_model_len, policy, max_queued)
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token written there
        self.bs = block_size
        self.n = 0
        self.spec = spec  # up to this many speculative proposals per decoding request and step
        self.copies = 0  # copies on write made (a prompt's last token computed in a cached block)

    def add(self, prompt, max_tokens, priority=0):
        self.n += 1
        r = Request(
            f"r{self.n}",
            prompt,
            SamplingParams(max_tokens=max_tokens),
            {999},
            priority=priority,
            arrival_time=float(self.n),
        )
        self.sched.add_request(r)
        return r

    def check_contents(self):
        for r in self.sched.running:
            ids = self.kv.get_block_ids(r.request_id)
            for pos in range(r.num_computed_tokens):
                key = (ids[pos // self.bs], pos % self.bs)
                assert self.slots.get(key) == r.all_token_ids[pos], (r, pos)

    def write(self, r, c, tokens):
        """The runner's KV write: `tokens` at positions c, c + 1, ... of `r`'s blocks."""
        ids = self.kv.get_block_ids(r.request_id)
        assert len(ids) * self.bs >= c + len(tokens)
        for pos, token in zip(range(c, c + len(tokens)), tokens):
            self.slots[(ids[pos // self.bs], pos % self.bs)] = token

    def propose(self, rng):
        # random proposals for decoding requests (the engine's n-gram ones, without the n-grams)
        for r in self.sched.running:
            decoding = r.num_tokens - r.num_computed_tokens == 1
            r.spec_token_ids = [rng.randrange(50) for _ in range(rng.randrange(self.spec + 1))] if decoding else []

    def step(self, rng):
        if self.spec:
            self.propose(rng)
        out = self.sched.schedule()
        for src, dst in out.block_copies:  # the runner's copies on write, before the step
            for i in range(self.bs):
                if (src, i) in self.slots:
                    self.slots[(dst, i)] = self.slots[(src, i)]
        self.copies += len(out.block_copies)
        sampled = []
        for r in out.requests:  # the runner: write the scheduled tokens, sample where the known ones end
            n = out.num_scheduled_tokens[r.request_id]
            k = out.num_spec_tokens.get(r.request_id, 0)
            c = r.num_computed_tokens
            self.write(r, c, r.all_token_ids[c : c + n - k] + r.spec_token_ids[:k])
            if c + n - k >= r.num_tokens:
                # one token per verified position: the proposal itself half of the time
                tokens = [t if rng.random() < 0.5 else rng.randrange(50) for t in r.spec_token_ids[:k]]
                sampled.append(SampledTokens(r, tokens + [rng.randrange(50)]))
        self.sched.update_from_output(out, sampled)
        self.check_contents()
        return out

    def check_pool(self):
        pool = self.kv.pool
        held = {}
        for blocks in self.kv.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0), b
        free_ids = [b.block_id for b in pool.free_queue]
        assert len(free_ids) == len(set(free_ids)) == pool.num_free
        assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}


ops = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "step", "abort", "finish", "preempt"]), st.integers(0, 10_000)),
    min_size=1,
    max_size=120,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_seqs=st.integers(1, 6),
    budget=st.integers(1, 64),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    spec=st.sampled_from([0, 0, 3]),
)
def test_random_interleavings_never_leak_or_corrupt(
    ops, num_blocks, block_size, max_seqs, budget, caching, policy, spec
):
    sim = Sim(num_blocks, block_size, max_seqs, budget, caching, policy, spec=spec)
    rng = random.Random(0)
    # A few documents, so that prompts often repeat prefixes of each other (and of evicted blocks).
    docs = [[random.Random(d).randrange(50) for _ in range(40)] for d in range(3)]
    for op, x in ops:
        if op == "add":
            plen = 1 + (x // 7) % max(1, min(40, sim.max_model_len - 2))
            prompt = docs[x % 3][:plen] if x % 4 else [(x * 7 + i) % 50 for i in range(plen)]
            sim.add(prompt, 1 + x % 12, priority=x % 3)
        elif op == "step":
            sim.step(rng)
        elif op in ("abort", "finish") and sim.sched.requests:
            rid = sorted(sim.sched.requests)[x % len(sim.sched.requests)]
            status = RequestStatus.FINISHED_ABORTED if op == "abort" else RequestStatus.FINISHED_STOPPED
            sim.sched.finish_request(rid, status)
        elif op == "preempt" and sim.sched.running:
            sim.sched._preempt(sim.sched.running[x % len(sim.sched.running)], SchedulerOutput())
        sim.check_pool()
    # drain: everything finishes, nothing leaks
    for _ in range(5000):
        if not sim.sched.has_unfinished():
            break
        sim.step(rng)
        sim.check_pool()
    assert not sim.sched.has_unfinished()
    assert sim.kv.num_free_blocks == num_blocks
    assert sim.kv.usage == 0.0


def test_prefix_hit_skips_cached_blocks():
    sim = Sim(num_blocks=64, block_size=4, max_seqs=4, budget=64, caching=True)
    prompt = list(range(30))
    sim.add(prompt, 2)
    while sim.sched.has_unfinished():
        sim.step(random.Random(1))
    b = sim.add(prompt[:28] + [99, 98], 2)
    out = sim.step(random.Random(1))
    assert b.num_cached_tokens == 28  # 7 full blocks of 4
    assert out.num_scheduled_tokens[b.request_id] == 2
    assert sim.kv.prefix_cache_hits == 28


def _drain(sim, rng):
    while sim.sched.has_unfinished():
        sim.step(rng)


def test_a_cached_prompt_of_whole_blocks_recomputes_its_last_token_only():
    sim = Sim(num_blocks=32, block_size=4, max_seqs=4, budget=64, caching=True)
    rng = random.Random(1)
    prompt = [7 + i for i in range(32)]  # 8 whole blocks
    sim.add(prompt, 3)
    _drain(sim, rng)
    b = sim.add(prompt, 2)
    cached = [sim.kv.pool.get_cached(h).block_id for h in sim.kv._update_block_hashes(b)[:8]]
    out = sim.step(rng)  # (its check_contents: positions 0..30 of b's blocks hold the prompt)
    assert b.num_cached_tokens == 31 and sim.kv.prefix_cache_hits == 31
    assert out.num_scheduled_tokens[b.request_id] == 1
    ids = sim.kv.get_block_ids(b.request_id)
    # the block holding the last token is b's own copy of the cached one, which stays as it was
    assert ids[:7] == cached[:7] and ids[7] not in cached
    assert out.block_copies == [(cached[7], ids[7])]
    assert (
        sim.kv.pool.blocks[cached[7]].ref_cnt == 0 and sim.kv.pool.get_cached(b.block_hashes[7]).block_id == cached[7]
    )
    _drain(sim, rng)
    sim.check_pool()
    assert sim.kv.num_free_blocks == 32


def test_a_cached_block_that_begins_with_the_prompts_tail_is_used_up_to_the_last_token():
    sim = Sim(num_blocks=32, block_size=4, max_seqs=4, budget=64, caching=True)
    rng = random.Random(2)
    prompt = list(range(30))  # 7 whole blocks and 2 tokens
    sim.add(prompt, 3)  # its 8th block, [28, 29, out1, out2], is named once full
    _drain(sim, rng)
    again = sim.add(prompt, 2)
    out = sim.step(rng)
    assert again.num_cached_tokens == 29 and out.num_scheduled_tokens[again.request_id] == 1
    assert len(out.block_copies) == 1
    other = sim.add(prompt[:28] + [28, 77], 2)  # the same block does not begin with this tail
    out = sim.step(rng)
    assert other.num_cached_tokens == 28 and out.num_scheduled_tokens[other.request_id] == 2
    salted = Request("salted", list(prompt), SamplingParams(max_tokens=2), {999}, cache_salt="t2")
    sim.sched.add_request(salted)
    sim.step(rng)
    assert salted.num_cached_tokens == 0  # another tenant's blocks, tail included, are not its
    _drain(sim, rng)
    sim.check_pool()
    assert sim.kv.num_free_blocks == 32


def test_a_block_computed_in_the_same_step_is_not_copied():
    sim = Sim(num_blocks=32, block_size=4, max_seqs=4, budget=64, caching=True)
    prompt = [3 + i for i in range(32)]
    a, b = sim.add(prompt, 2), sim.add(prompt, 2)
    out = sim.step(random.Random(3))
    # b shares a's first 7 blocks (computed in this very step, before attention reads them), not the 8th: no
    # copy can be made of a block whose KV does not exist yet
    assert out.num_scheduled_tokens[a.request_id] == 32
    assert b.num_cached_tokens == 28 and out.num_scheduled_tokens[b.request_id] == 4 and out.block_copies == []
    _drain(sim, random.Random(3))
    sim.check_pool()


def test_lru_eviction_keeps_recent_prefixes():
    sim = Sim(num_blocks=8, block_size=4, max_seqs=1, budget=64, caching=True)
    rng = random.Random(2)
    for base in (0, 100):  # two prompts of 2 blocks + 1 token each (3 blocks while running)
        sim.add([base + i for i in range(9)], 1)
        while sim.sched.has_unfinished():
            sim.step(rng)
    sim.add([200 + i for i in range(9)], 1)  # needs 3 blocks: evicts the least recently used
    while sim.sched.has_unfinished():
        sim.step(rng)
    r = sim.add([100 + i for i in range(9)], 1)  # the second prompt is still cached
    sim.step(rng)
    assert r.num_cached_tokens == 8


def test_blocks_without_cached_contents_are_reused_first():
    """A freed block that holds nothing reusable (the partial last block; every block with caching off)
    goes to the front of the free list: the next request takes it before touching a fresh one, and the
    cached full blocks stay cached longer."""
    for caching in (True, False):
        sim = Sim(num_blocks=16, block_size=4, max_seqs=1, budget=64, caching=caching)
        rng = random.Random(3)
        used: set[int] = set()
        allocate = sim.kv.pool.allocate
        sim.kv.pool.allocate = lambda n, used=used, allocate=allocate: [used.add(b.block_id) or b for b in allocate(n)]
        for base in range(0, 500, 100):  # 5 requests of 2 full blocks + a partial one, one after another
            sim.add([base + i for i in range(9)], 1)
            while sim.sched.has_unfinished():
                sim.step(rng)
        # with caching: 2 new full blocks per request, the partial one reused; without: the same 3 blocks
        assert len(used) == (2 * 5 + 1 if caching else 3), (caching, sorted(used))


def test_preemption_instead_of_oom():
    sim = Sim(num_blocks=6, block_size=4, max_seqs=4, budget=64, caching=False)
    reqs = [sim.add(list(range(i, i + 6)), 10) for i in range(4)]
    rng = random.Random(3)
    for _ in range(500):
        if not sim.sched.has_unfinished():
            break
        sim.step(rng)
    assert all(r.is_finished for r in reqs)
    assert sim.sched.num_preemptions > 0
    assert sim.kv.num_free_blocks == 6


def test_priority_request_scheduled_at_once_when_pool_full():
    sim = Sim(num_blocks=8, block_size=4, max_seqs=8, budget=64, caching=False, policy="priority")
    low = [sim.add(list(range(10 * i, 10 * i + 14)), 50, priority=10) for i in range(2)]
    rng = random.Random(4)
    sim.step(rng)
    assert sim.kv.num_free_blocks == 0  # the pool is full of low-priority requests
    high = sim.add([1, 2, 3, 4, 5], 3, priority=0)
    out = sim.step(rng)
    assert high.request_id in out.num_scheduled_tokens
    assert out.preempted_request_ids and set(out.preempted_request_ids) <= {r.request_id for r in low}


def test_request_preempted_in_the_schedule_that_allocated_it_leaves_no_stale_cache():
    """A running request is given blocks for this step (and they are named by hash), then a higher-priority
    arrival preempts it in the same schedule: those blocks were never computed, so its re-admission must not
    find them in the prefix cache (found by the random-interleavings property test)."""
    sim = Sim(num_blocks=4, block_size=2, max_seqs=1, budget=3, caching=True, policy="priority")
    rng = random.Random(0)
    sim.add([8] * 5, 8, priority=1)
    sim.step(rng)  # 3 of 5 prompt tokens computed
    sim.add([0], 1, priority=0)  # preempts the first after its blocks for positions 3-4 were allocated
    for _ in range(6):
        sim.step(rng)  # check_contents: every computed position holds its token
        sim.check_pool()


def test_priority_request_scheduled_at_once_when_batch_full():
    sim = Sim(num_blocks=64, block_size=4, max_seqs=2, budget=64, caching=False, policy="priority")
    for _ in range(2):
        sim.add(list(range(5)), 50, priority=5)
    rng = random.Random(5)
    sim.step(rng)
    high = sim.add([9, 9, 9], 3, priority=-1)
    out = sim.step(rng)
    assert high.request_id in out.num_scheduled_tokens and len(out.preempted_request_ids) == 1


def test_full_queue_raises_typed_error_and_keeps_serving():
    # capacity = max_seqs + max_queued: a free running slot takes a request at the next step, so it
    # is not counted as waiting even before that step has run
    sim = Sim(num_blocks=16, block_size=4, max_seqs=1, budget=64, caching=False, max_queued=2)
    sim.add([1, 2, 3], 2)
    sim.add([4, 5, 6], 2)
    sim.add([1, 5, 9], 2)
    assert sim.sched.num_queued_after() == 2
    try:
        sim.add([7, 8, 9], 2)
        raise AssertionError("expected QueueFullError")
    except QueueFullError:
        pass
    rng = random.Random(6)
    while sim.sched.has_unfinished():
        sim.step(rng)
    last = sim.add([7, 8, 9], 2)  # room again
    while sim.sched.has_unfinished():
        sim.step(rng)
    assert last.is_finished and last.num_output_tokens == 2
    assert sim.kv.num_free_blocks == 16


def test_a_waiting_request_counts_its_prefix_hits_once_when_scheduled():
    # vLLM's semantics: prefix_cache_queries/hits count a request once, in the step that schedules it, not at each
    # look-up while it waits for room (a small pool looks it up again every step)
    sim = Sim(num_blocks=12, block_size=4, max_seqs=4, budget=64, caching=True)
    rng = random.Random(3)
    prompt = [7 + i for i in range(32)]  # 8 whole blocks, cached once the first request is done
    sim.add(prompt, 2)
    _drain(sim, rng)
    queries, hits = sim.kv.prefix_cache_queries, sim.kv.prefix_cache_hits
    c = sim.add([60 + i for i in range(13)], 3)  # 4 blocks held for 3 steps: 8 left, b needs 9
    b = sim.add(prompt + [1, 2, 3, 4], 2)
    waited = 0
    while b.status == RequestStatus.WAITING:
        out = sim.step(rng)
        waited += b.request_id not in out.num_scheduled_tokens
        assert not out.preempted_request_ids
    assert waited >= 2 and c.is_finished
    assert b.num_cached_tokens == 32
    assert sim.kv.prefix_cache_hits - hits == b.num_cached_tokens + c.num_cached_tokens == 32
    assert sim.kv.prefix_cache_queries - queries == b.num_prompt_tokens + c.num_prompt_tokens
    _drain(sim, rng)
    assert sim.kv.prefix_cache_hits - hits == 32  # (finishing counts nothing more)
