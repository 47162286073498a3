"""Routing policies: which backend gets a request.

Pure selection logic: no network, no asyncio, no clock. The router hands a policy the request's
routing facts (`RouteRequest`) and the backends that may take it (healthy, serving the model, not
saturated, not already tried); the policy answers with one backend and the reason it chose it.
The reason becomes a metric label (`llmserve_router:routing_decisions_total{reason=...}`).

Policies:

- `round_robin`         each backend in turn.
- `least_outstanding`   fewest in-flight requests (divided by weight); optionally the power of two
                        choices: sample two backends at random and take the less loaded one.
- `cache_aware`         (default) an approximate radix tree of recent prompts per backend sends a
                        request to the backend that most likely holds its prefix in its KV cache,
                        unless load is imbalanced (absolute *and* relative gap, as SGLang's router
                        does), in which case least outstanding wins.
- `session`             consistent hashing of a session key (a header or the `user` field) on a
                        ring with virtual nodes: stable when a backend joins or leaves.
- `length`              prompt-length buckets: each backend declares the prompt lengths it takes;
                        least outstanding inside the bucket.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field

# Reasons, as they appear in metrics.
REASON_ROUND_ROBIN = "round_robin"
REASON_LEAST_LOADED = "least_outstanding"
REASON_CACHE_HIT = "cache_hit"
REASON_CACHE_MISS = "cache_miss"
REASON_BALANCE = "balance"
REASON_SESSION = "session"
REASON_LENGTH = "length"
REASON_LENGTH_FALLBACK = "length_fallback"


@dataclass(eq=False)
class Backend:
    """One upstream server as the router sees it. Identity is the object (`eq=False`)."""

    url: str
    models: set[str] = field(default_factory=set)
    models_declared: bool = False  # models come from config, not from /v1/models
    model_cards: dict[str, dict] = field(default_factory=dict)  # the backend's /v1/models entries
    weight: float = 1.0
    min_prompt_tokens: int = 0
    max_prompt_tokens: int | None = None  # None: no upper bound
    max_outstanding: int | None = None  # None: router default
    source: str = "static"  # static | yaml | dns:<name>
    # live state, updated by the router and the health checker
    healthy: bool = False
    ever_healthy: bool = False
    ejected_reason: str | None = "not checked yet"
    outstanding: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # load scraped from the backend's /metrics (None until scraped)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None

    def load(self, use_metrics: bool = False) -> float:
        """Requests in flight, as the router counts them, or as the backend reports them when
        metrics are scraped and show more (other clients, other routers)."""
        n = float(self.outstanding)
        if use_metrics and self.running is not None:
            n = max(n, (self.running or 0.0) + (self.waiting or 0.0))
        return n / max(self.weight, 1e-9)

    def takes_length(self, prompt_tokens: int) -> bool:
        if prompt_tokens < self.min_prompt_tokens:
            return False
        return self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens

    def __repr__(self) -> str:  # short, for logs
        return f"Backend({self.url}, healthy={self.healthy}, outstanding={self.outstanding})"


@dataclass
class RouteRequest:
    """What a policy may look at: no body, no headers beyond the session key."""

    model: str | None = None
    prompt_text: str = ""  # prompt, or the chat messages flattened
    prompt_tokens: int = 0  # an estimate (characters / chars_per_token)
    max_tokens: int | None = None
    session_key: str | None = None
    stream: bool = False


@dataclass
class Decision:
    backend: Backend
    reason: str


class Policy:
    name = "base"

    def __init__(self, use_metrics: bool = False):
        self.use_metrics = use_metrics

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        raise NotImplementedError

    def on_routed(self, req: RouteRequest, backend: Backend) -> None:
        """Called once the request was handed to `backend` (first attempt or a retry)."""

    def on_backend_removed(self, backend: Backend) -> None:
        """Called when discovery drops a backend for good."""

    # shared helper: least loaded, ties broken in turn so equal backends share the work
    _tie = 0

    def least_loaded(self, candidates: list[Backend]) -> Backend:
        loads = [b.load(self.use_metrics) for b in candidates]
        low = min(loads)
        tied = [b for b, x in zip(candidates, loads) if x == low]
        if len(tied) == 1:
            return tied[0]
        self._tie += 1
        return tied[self._tie % len(tied)]


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, use_metrics: bool = False):
        super().__init__(use_metrics)
        self._next = 0

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        # Candidates change with health and model; index over a stable order (by URL).
        ordered = sorted(candidates, key=lambda b: b.url)
        b = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(b, REASON_ROUND_ROBIN)


class LeastOutstanding(Policy):
    name = "least_outstanding"

    def __init__(self, use_metrics: bool = False, power_of_two: bool = False, rng: random.Random | None = None):
        super().__init__(use_metrics)
        self.power_of_two = power_of_two
        self.rng = rng or random.Random()

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        if self.power_of_two and len(candidates) > 2:
            candidates = self.rng.sample(candidates, 2)
        return Decision(self.least_loaded(candidates), REASON_LEAST_LOADED)


# ----------------------------------------------------------------------------------------------
# cache_aware: an approximate radix tree of the prompts each backend has recently seen
# ----------------------------------------------------------------------------------------------


class _Node:
    __slots__ = ("label", "children", "tenants")

    def __init__(self, label: str = ""):
        self.label = label  # edge label from the parent
        self.children: dict[str, _Node] = {}  # first character -> child
        self.tenants: dict[int, int] = {}  # backend id -> how many stored prompts pass here


class PrefixTree:
    """A radix tree over prompt text shared by all backends ("tenants").

    Every node counts, per tenant, how many of that tenant's stored prompts pass through it, so a
    tenant present at a node is present at all its ancestors. `match` returns, per tenant, the
    length of the longest stored prefix; `insert`/`remove` keep the counts. Each tenant keeps its
    most recent prompts up to `max_chars_per_tenant` characters (an LRU, like the KV cache it
    approximates); older ones are removed from the tree.
    """

    def __init__(self, max_chars_per_tenant: int = 200_000, max_prompt_chars: int = 32_768):
        self.root = _Node()
        self.max_chars_per_tenant = max_chars_per_tenant
        self.max_prompt_chars = max_prompt_chars
        self._recent: dict[int, OrderedDict[str, int]] = {}  # tenant -> prompt -> length
        self._chars: dict[int, int] = {}

    # -- queries --
    def match(self, text: str) -> dict[int, int]:
        text = text[: self.max_prompt_chars]
        matched: dict[int, int] = {}
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            n = _common_prefix_len(child.label, text, i)
            for t in child.tenants:
                matched[t] = i + n  # deeper nodes overwrite shallower ones
            if n < len(child.label):
                break
            node, i = child, i + n
        return matched

    def size(self, tenant: int) -> int:
        return self._chars.get(tenant, 0)

    # -- updates --
    def insert(self, text: str, tenant: int) -> None:
        text = text[: self.max_prompt_chars]
        if not text:
            return
        recent = self._recent.setdefault(tenant, OrderedDict())
        if text in recent:  # already stored: refresh its recency only
            recent.move_to_end(text)
            return
        self._add_path(text, tenant, +1)
        recent[text] = len(text)
        self._chars[tenant] = self._chars.get(tenant, 0) + len(text)
        while self._chars[tenant] > self.max_chars_per_tenant and len(recent) > 1:
            old, n = recent.popitem(last=False)
            self._chars[tenant] -= n
            self._add_path(old, tenant, -1)

    def remove_tenant(self, tenant: int) -> None:
        for text in list(self._recent.pop(tenant, {})):
            self._add_path(text, tenant, -1)
        self._chars.pop(tenant, None)

    def _add_path(self, text: str, tenant: int, delta: int) -> None:
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                if delta < 0:
                    return
                child = _Node(text[i:])
                node.children[text[i]] = child
            n = _common_prefix_len(child.label, text, i)
            if n < len(child.label):
                if delta < 0:  # a removal always follows an inserted path
                    return
                child = self._split(node, child, n)
            count = child.tenants.get(tenant, 0) + delta
            if count > 0:
                child.tenants[tenant] = count
            else:
                child.tenants.pop(tenant, None)
                if not child.tenants:  # counts shrink downwards: the subtree is empty
                    del node.children[child.label[0]]
                    return
            node, i = child, i + n

    @staticmethod
    def _split(parent: _Node, child: _Node, n: int) -> _Node:
        mid = _Node(child.label[:n])
        mid.tenants = dict(child.tenants)
        child.label = child.label[n:]
        mid.children[child.label[0]] = child
        parent.children[mid.label[0]] = mid
        return mid


def _common_prefix_len(label: str, text: str, start: int) -> int:
    """Length of the common prefix of `label` and `text[start:]`, by slice comparisons (done in C)
    and a binary search for the first difference: prompts are long and usually match whole."""
    n = min(len(label), len(text) - start)
    if label[:n] == text[start : start + n]:
        return n
    lo, hi = 0, n  # label[:lo] matches, label[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if label[lo:mid] == text[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class CacheAware(Policy):
    """SGLang-style cache-aware routing.

    1. If load is imbalanced (max - min > `balance_abs_threshold` and max > min *
       `balance_rel_threshold`), route to the least loaded backend ("balance").
    2. Otherwise find the backend whose stored prompts share the longest prefix with this one. If
       the matched fraction exceeds `cache_threshold`, route there ("cache_hit").
    3. Else route to the backend with the smallest tree, i.e. the most free cache ("cache_miss"),
       ties broken by load.
    The prompt is then recorded in the chosen backend's tree.
    """

    name = "cache_aware"

    def __init__(
        self,
        use_metrics: bool = False,
        cache_threshold: float = 0.5,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.5,
        max_chars_per_tenant: int = 200_000,
    ):
        super().__init__(use_metrics)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_chars_per_tenant=max_chars_per_tenant)

    def imbalanced(self, candidates: list[Backend]) -> bool:
        loads = [b.load(self.use_metrics) for b in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        if len(candidates) > 1 and self.imbalanced(candidates):
            return Decision(self.least_loaded(candidates), REASON_BALANCE)
        text = req.prompt_text
        if text:
            matched = self.tree.match(text)
            best, best_len = None, 0
            for b in candidates:
                n = matched.get(id(b), 0)
                if n > best_len or (
                    n == best_len
                    and best is not None
                    and n > 0
                    and b.load(self.use_metrics) < best.load(self.use_metrics)
                ):
                    best, best_len = b, n
            if best is not None and best_len / min(len(text), self.tree.max_prompt_chars) > self.cache_threshold:
                return Decision(best, REASON_CACHE_HIT)
        smallest = min(self.tree.size(id(b)) for b in candidates)
        emptiest = [b for b in candidates if self.tree.size(id(b)) == smallest]
        return Decision(self.least_loaded(emptiest), REASON_CACHE_MISS)

    def on_routed(self, req: RouteRequest, backend: Backend) -> None:
        if req.prompt_text:
            self.tree.insert(req.prompt_text, id(backend))

    def on_backend_removed(self, backend: Backend) -> None:
        self.tree.remove_tenant(id(backend))


# ----------------------------------------------------------------------------------------------
# session: consistent hashing
# ----------------------------------------------------------------------------------------------


def _hash64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes. Keys move only to or from a backend that joins or
    leaves; all other keys keep their backend."""

    def __init__(self, nodes: list[str] = (), vnodes: int = 160):
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        for n in nodes:
            self.add(n)

    def add(self, node: str) -> None:
        for v in range(self.vnodes):
            h = _hash64(f"{node}#{v}")
            i = bisect.bisect(self._points, h)
            self._points.insert(i, h)
            self._owners.insert(i, node)

    def remove(self, node: str) -> None:
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def lookup(self, key: str, allowed: set[str] | None = None) -> str | None:
        """The first node clockwise from the key's hash, skipping nodes not in `allowed`."""
        if not self._points:
            return None
        start = bisect.bisect(self._points, _hash64(key))
        n = len(self._points)
        for k in range(n):
            owner = self._owners[(start + k) % n]
            if allowed is None or owner in allowed:
                return owner
        return None


class Session(Policy):
    """Requests with the same session key go to the same backend. The ring holds every backend
    the policy has seen (healthy or not), and a lookup skips the ones not among the candidates,
    so an ejected backend's sessions move to their ring successors and come back on
    re-admission, while all other sessions stay put. Requests without a key fall back to
    least outstanding."""

    name = "session"

    def __init__(self, use_metrics: bool = False, vnodes: int = 160):
        super().__init__(use_metrics)
        self.ring = HashRing(vnodes=vnodes)
        self._members: set[str] = set()

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        for b in candidates:
            if b.url not in self._members:
                self._members.add(b.url)
                self.ring.add(b.url)
        if not req.session_key:
            return Decision(self.least_loaded(candidates), REASON_LEAST_LOADED)
        by_url = {b.url: b for b in candidates}
        url = self.ring.lookup(req.session_key, set(by_url))
        return Decision(by_url[url], REASON_SESSION)

    def on_backend_removed(self, backend: Backend) -> None:
        if backend.url in self._members:
            self._members.discard(backend.url)
            self.ring.remove(backend.url)


# ----------------------------------------------------------------------------------------------
# length: prompt-length buckets
# ----------------------------------------------------------------------------------------------


class Length(Policy):
    """Only backends whose declared range [min_prompt_tokens, max_prompt_tokens] holds the
    prompt's length take it (least outstanding among them). A prompt no range holds goes to the
    backends with the largest upper bound ("length_fallback"), so nothing is refused here: the
    backend itself says if the prompt is too long for its model."""

    name = "length"

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        fit = [b for b in candidates if b.takes_length(req.prompt_tokens)]
        if fit:
            return Decision(self.least_loaded(fit), REASON_LENGTH)
        top = max(float("inf") if b.max_prompt_tokens is None else b.max_prompt_tokens for b in candidates)
        widest = [
            b for b in candidates if (float("inf") if b.max_prompt_tokens is None else b.max_prompt_tokens) == top
        ]
        return Decision(self.least_loaded(widest), REASON_LENGTH_FALLBACK)


POLICIES = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "cache_aware": CacheAware,
    "session": Session,
    "length": Length,
}


def make_policy(name: str, **options) -> Policy:
    """Build a policy by name; options a policy does not take are ignored."""
    import inspect

    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted and v is not None})
