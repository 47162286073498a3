"""Routing policies on fake backends: pure selection logic, no network."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.router.policies import (
    POLICIES,
    Backend,
    CacheAware,
    Decision,
    HashRing,
    LeastOutstanding,
    Length,
    PrefixTree,
    RoundRobin,
    RouteRequest,
    Session,
    make_policy,
)


def backends(n: int, **kw) -> list[Backend]:
    return [Backend(url=f"http://10.0.0.{i + 1}:8000", healthy=True, **kw) for i in range(n)]


def req(text: str = "", **kw) -> RouteRequest:
    return RouteRequest(prompt_text=text, prompt_tokens=len(text) // 4, **kw)


# -- every policy, one row each: a new policy adds its row ------------------------------------------
# (name, make_policy options, each backend's state, the request, the backend it must choose, the reason)
POLICY_ROWS = [
    ("round_robin", {}, [{}, {}, {}], {}, 0, "round_robin"),
    ("least_outstanding", {}, [{"outstanding": 3}, {"outstanding": 1}, {"outstanding": 2}], {}, 1, "least_outstanding"),
    (
        "cache_aware",
        {},
        [{"outstanding": 2}, {"outstanding": 1}, {"outstanding": 2}],
        {"text": "x" * 40},
        1,
        "cache_miss",
    ),
    ("session", {}, [{}, {}, {}], {"session_key": "user-1"}, 0, "session"),
    (
        "length",
        {},
        [{"max_prompt_tokens": 512}, {"min_prompt_tokens": 513}, {"max_prompt_tokens": 100}],
        {"text": "x" * 4000},
        1,
        "length",
    ),
]


def test_every_registered_policy_has_its_row():
    assert [row[0] for row in POLICY_ROWS] == list(POLICIES)


@pytest.mark.parametrize("name, options, state, request_, want, reason", POLICY_ROWS, ids=[r[0] for r in POLICY_ROWS])
def test_each_policy_chooses_a_candidate_and_says_why(name, options, state, request_, want, reason):
    bs = [Backend(url=f"http://10.0.0.{i + 1}:8000", healthy=True, **s) for i, s in enumerate(state)]
    loads = [b.outstanding for b in bs]
    p = make_policy(name, **options)
    assert p.name == name
    r = req(**request_)
    d = p.choose(r, bs)
    assert (bs.index(d.backend), d.reason) == (want, reason)
    assert [b.outstanding for b in bs] == loads  # pure: the router counts, the policy only chooses
    p.on_routed(r, d.backend)
    p.on_backend_removed(d.backend)  # discovery dropped it: the others still take requests
    assert p.choose(r, [b for b in bs if b is not d.backend]).backend is not d.backend


# -- round robin ---------------------------------------------------------------------------------


def test_round_robin_takes_each_backend_in_turn():
    bs = backends(3)
    p = RoundRobin()
    picks = [p.choose(req(), bs).backend for _ in range(6)]
    assert picks == bs + bs
    # a backend leaving the candidate set is skipped, the others still alternate
    picks = [p.choose(req(), bs[:2]).backend for _ in range(4)]
    assert Counter(picks) == {bs[0]: 2, bs[1]: 2}


# -- least outstanding ---------------------------------------------------------------------------


def test_least_outstanding_picks_fewest_in_flight():
    a, b, c = backends(3)
    a.outstanding, b.outstanding, c.outstanding = 5, 1, 3
    d = LeastOutstanding().choose(req(), [a, b, c])
    assert d.backend is b and d.reason == "least_outstanding"


def test_least_outstanding_divides_by_weight_and_spreads_ties():
    a, b = backends(2)
    a.weight, a.outstanding, b.outstanding = 4.0, 6, 2  # 1.5 vs 2.0
    assert LeastOutstanding().choose(req(), [a, b]).backend is a
    a.weight, a.outstanding, b.outstanding = 1.0, 0, 0
    p = LeastOutstanding()
    assert {p.choose(req(), [a, b]).backend for _ in range(4)} == {a, b}


def test_least_outstanding_uses_scraped_load_when_enabled():
    a, b = backends(2)
    a.running, a.waiting = 7, 3  # busy with someone else's traffic
    b.running, b.waiting = 0, 0
    a.outstanding = b.outstanding = 1
    assert LeastOutstanding(use_metrics=True).choose(req(), [a, b]).backend is b


def test_power_of_two_choices_takes_the_better_of_two_samples():
    bs = backends(5)
    for i, b in enumerate(bs):
        b.outstanding = 10 * i
    p = LeastOutstanding(power_of_two=True, rng=random.Random(0))
    for _ in range(50):
        d = p.choose(req(), bs)
        # never the most loaded: it can only win if sampled with itself
        assert d.backend is not bs[-1]
    counts = Counter(p.choose(req(), bs).backend.url for _ in range(500))
    assert len(counts) >= 3  # not a plain argmin: load spreads


# -- cache aware ---------------------------------------------------------------------------------

SYSTEM = [
    "You are a pirate assistant. " * 20,
    "You are a legal clerk. Be precise. " * 20,
    "Answer only in haiku about the sea. " * 20,
    "You translate to French. " * 20,
]


def test_cache_aware_follows_the_prefix_and_spreads_new_prefixes():
    bs = backends(2)
    p = CacheAware()
    first = {}
    for i, s in enumerate(SYSTEM):
        d = p.choose(req(s + f"user question {i}"), bs)
        assert d.reason == "cache_miss"
        p.on_routed(req(s + f"user question {i}"), d.backend)
        first[s] = d.backend
    # new prefixes went to the emptiest tree: two system prompts per backend
    assert Counter(first.values()) == {bs[0]: 2, bs[1]: 2}
    for s in SYSTEM:
        for u in range(5):
            d = p.choose(req(s + f"another user {u} asks"), bs)
            assert d.reason == "cache_hit" and d.backend is first[s]
            p.on_routed(req(s + f"another user {u} asks"), d.backend)


def test_cache_aware_balances_when_load_is_imbalanced():
    a, b = backends(2)
    p = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    r = req(SYSTEM[0] + "q")
    p.on_routed(r, a)
    a.outstanding, b.outstanding = 10, 1  # gap 9 > 4 and 10 > 1.5
    d = p.choose(r, [a, b])
    assert d.backend is b and d.reason == "balance"
    a.outstanding, b.outstanding = 4, 1  # gap 3: small, the cache wins
    d = p.choose(r, [a, b])
    assert d.backend is a and d.reason == "cache_hit"


def test_cache_aware_forgets_a_removed_backend():
    a, b = backends(2)
    p = CacheAware()
    p.on_routed(req(SYSTEM[0]), a)
    p.on_backend_removed(a)
    assert p.tree.match(SYSTEM[0]) == {}
    assert p.choose(req(SYSTEM[0]), [a, b]).reason == "cache_miss"


def test_prefix_tree_match_split_and_eviction():
    t = PrefixTree(max_chars_per_tenant=30)
    t.insert("hello world", 1)
    t.insert("hello there", 2)
    t.insert("help", 1)
    assert t.match("hello world!") == {1: 11, 2: 6}
    assert t.match("helpful") == {1: 4, 2: 3}
    assert t.match("xyz") == {}
    # tenant 1 holds 15 chars; adding 20 more evicts its oldest prompt ("hello world")
    t.insert("a" * 20, 1)
    assert t.size(1) == 24
    assert t.match("hello world") == {1: 3, 2: 6}  # only "help" is left: "hel"
    t.remove_tenant(2)
    assert t.match("hello there") == {1: 3}
    t.remove_tenant(1)
    assert t.root.children == {}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.text("ab", min_size=1, max_size=12), st.integers(0, 2)), max_size=25),
    st.text("ab", max_size=14),
)
def test_prefix_tree_matches_brute_force(ops, query):
    t = PrefixTree(max_chars_per_tenant=40)
    stored: dict[int, list[str]] = {}
    for text, tenant in ops:
        t.insert(text, tenant)
        lst = stored.setdefault(tenant, [])
        if text in lst:
            lst.remove(text)
        lst.append(text)
        while sum(map(len, lst)) > 40 and len(lst) > 1:
            lst.pop(0)

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    want = {}
    for tenant, texts in stored.items():
        best = max((lcp(s, query) for s in texts), default=0)
        if best:
            want[tenant] = best
    assert t.match(query) == want


# -- session -------------------------------------------------------------------------------------


def test_session_sticks_and_falls_back_without_a_key():
    bs = backends(3)
    p = Session()
    owner = {f"user-{i}": p.choose(req(session_key=f"user-{i}"), bs).backend for i in range(50)}
    for k, b in owner.items():
        d = p.choose(req(session_key=k), bs)
        assert d.backend is b and d.reason == "session"
    assert len(set(owner.values())) == 3
    assert p.choose(req(), bs).reason == "least_outstanding"


def test_consistent_hashing_is_stable_when_a_backend_joins_or_leaves():
    bs = backends(4)
    keys = [f"session-{i}" for i in range(2000)]
    p = Session()
    before = {k: p.choose(req(session_key=k), bs[:3]).backend for k in keys}
    after = {k: p.choose(req(session_key=k), bs).backend for k in keys}  # bs[3] joins
    moved = [k for k in keys if before[k] is not after[k]]
    assert all(after[k] is bs[3] for k in moved)  # keys only move to the newcomer
    assert 0.15 < len(moved) / len(keys) < 0.40  # about a quarter of them
    # bs[0] is ejected: only its keys move; it comes back and they return
    gone = {k: p.choose(req(session_key=k), bs[1:]).backend for k in keys}
    assert all(gone[k] is after[k] for k in keys if after[k] is not bs[0])
    back = {k: p.choose(req(session_key=k), bs).backend for k in keys}
    assert back == after


def test_hash_ring_remove():
    ring = HashRing(["a", "b", "c"], vnodes=50)
    owners = {k: ring.lookup(k) for k in map(str, range(500))}
    ring.remove("b")
    for k, o in owners.items():
        if o != "b":
            assert ring.lookup(k) == o
        else:
            assert ring.lookup(k) in {"a", "c"}


# -- length --------------------------------------------------------------------------------------


def test_length_buckets_route_by_prompt_length():
    short, long_ = backends(2)
    short.max_prompt_tokens = 512
    long_.min_prompt_tokens = 513
    p = Length()
    d = p.choose(RouteRequest(prompt_tokens=100), [short, long_])
    assert d.backend is short and d.reason == "length"
    d = p.choose(RouteRequest(prompt_tokens=4000), [short, long_])
    assert d.backend is long_ and d.reason == "length"
    # the long pool is ejected: a long prompt falls back to the widest remaining bucket
    d = p.choose(RouteRequest(prompt_tokens=4000), [short])
    assert d.backend is short and d.reason == "length_fallback"


def test_length_pool_uses_least_outstanding_inside_the_bucket():
    a, b, c = backends(3)
    a.max_prompt_tokens = b.max_prompt_tokens = 512
    c.min_prompt_tokens = 513
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 0
    assert Length().choose(RouteRequest(prompt_tokens=10), [a, b, c]).backend is b


def test_make_policy():
    assert make_policy("least_outstanding", power_of_two=True, cache_threshold=0.9).power_of_two
    assert make_policy("cache_aware", cache_threshold=0.9).cache_threshold == 0.9
    with pytest.raises(ValueError):
        make_policy("random")


# -- cache_aware on the engines' KV events ------------------------------------------------------------
def _engine_cache(num_blocks: int = 8, block_size: int = 4, max_events: int = 10_000):
    """A real KV cache manager of an engine, publishing its block events."""
    from llmserve.engine.kv_cache import KVCacheManager
    from llmserve.engine.kv_events import KVEventLog

    return KVCacheManager(num_blocks, block_size, events=KVEventLog(block_size, max_events))


def _run(kv, rid: str, tokens: list[int]) -> None:
    """A request computes its prompt and finishes (its full blocks stay cached, free)."""
    from llmserve.engine.request import Request
    from llmserve.sampling_params import SamplingParams

    r = Request(rid, tokens, SamplingParams(max_tokens=1))
    computed, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, len(tokens) - n, computed) is not None
    r.num_computed_tokens = len(tokens)
    kv.free(r)


def test_cache_aware_routes_on_kv_events_and_never_on_an_evicted_prefix():
    from llmserve.router.health import apply_kv_events

    a_kv, b_kv = _engine_cache(), _engine_cache()
    a, b = backends(2)
    prompt = list(range(100, 121))  # 5 full blocks of 4
    _run(a_kv, "1", prompt)
    for backend, kv in ((a, a_kv), (b, b_kv)):
        apply_kv_events(backend, kv.events.since(backend.kv_events_seq))
    assert len(a.kv_blocks) == 5 and b.kv_blocks == set()
    policy = CacheAware()
    r = req("the prompt's text", token_ids=prompt)
    policy.on_routed(r, b)  # the guessed tree says b: the events say a
    assert policy.choose(r, [a, b]) == Decision(a, "cache_hit")
    # a evicts the prompt's blocks (two other prompts take its whole pool): the router reads the removals
    _run(a_kv, "2", list(range(200, 216)))
    _run(a_kv, "3", list(range(300, 316)))
    before = a.kv_events_seq
    body = a_kv.events.since(before)
    assert not body["reset"] and {e["type"] for e in body["events"]} == {"BlockStored", "BlockRemoved"}
    apply_kv_events(a, body)
    assert a.kv_events_seq > before and len(a.kv_blocks) == 8
    d = policy.choose(r, [a, b])
    assert d.reason == "cache_miss"
    # a partly evicted prefix counts only up to its first missing block
    _run(b_kv, "4", prompt[:12] + [1] * 9)
    apply_kv_events(b, b_kv.events.since(b.kv_events_seq))
    assert sum(1 for _ in policy.matched(r, [b])) == 1 and next(policy.matched(r, [b]))[1] == 12 / 21


def test_cache_aware_keeps_the_tree_for_backends_without_events():
    a, c = backends(2)
    a.kv_blocks = set()  # publishes events, holds nothing
    policy = CacheAware()
    r = req("a long shared system prompt " * 4, token_ids=list(range(40)))
    policy.on_routed(r, c)  # c publishes nothing: its tree entry stands
    assert policy.choose(r, [a, c]) == Decision(c, "cache_hit")
    assert policy.choose(req("a long shared system prompt " * 4), [a, c]) == Decision(c, "cache_hit")  # no tokens


def test_kv_event_log_snapshot_when_the_reader_is_behind_or_new():
    from llmserve.router.health import apply_kv_events

    kv = _engine_cache(num_blocks=4, max_events=2)
    reader = backends(1)[0]
    _run(kv, "1", list(range(9)))  # 2 blocks stored (one event)
    apply_kv_events(reader, kv.events.since(-1))
    seen = reader.kv_events_seq
    for i in range(3):  # many runs: the log keeps only its last 2 events
        _run(kv, str(i + 2), list(range(1000 * (i + 1), 1000 * (i + 1) + 9)))
    body = kv.events.since(seen)
    assert body["reset"] and body["events"][0]["type"] == "AllBlocksCleared"
    apply_kv_events(reader, body)
    want = {kv.events._by_block[b.block_id] for b in kv.pool.cached.values()}
    assert want and reader.kv_blocks == want
    assert kv.events.since(10**9)["reset"]  # a sequence number this log never gave (another process's)
