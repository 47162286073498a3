"""Routing policies: which backend gets a request. One module per policy, all of them pure selection
logic (no network, no asyncio, no clock) over base.py's types: the router hands a policy the request's
routing facts (`RouteRequest`) and the backends that may take it; the policy answers with one backend and
the reason it chose it (a metric label: `llmserve_router:routing_decisions_total{reason=...}`).

    round_robin.py        each backend in turn
    least_outstanding.py  fewest in-flight requests per weight; optionally the power of two choices
    cache_aware.py        (default) the backend most likely to hold the prompt's prefix in its KV cache,
                          unless load is imbalanced (SGLang's router's rule)
    session.py            consistent hashing of a session key: stable when a backend joins or leaves
    length.py             prompt-length buckets, least outstanding inside the bucket

A new policy: one module here, one entry in POLICIES, one row in tests/unit/test_router_policies.py
(docs/contributing.md).
"""

from __future__ import annotations

import inspect

from .base import Backend, Decision, Policy, RouteRequest
from .cache_aware import CacheAware, PrefixTree
from .least_outstanding import LeastOutstanding
from .length import Length
from .round_robin import RoundRobin
from .session import HashRing, Session

__all__ = [
    "POLICIES",
    "Backend",
    "CacheAware",
    "Decision",
    "HashRing",
    "LeastOutstanding",
    "Length",
    "Policy",
    "PrefixTree",
    "RoundRobin",
    "RouteRequest",
    "Session",
    "make_policy",
]

# name (--policy) -> class
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RoundRobin, LeastOutstanding, CacheAware, Session, Length)
}


def make_policy(name: str, **options) -> Policy:
    """Build a policy by name; options a policy does not take are ignored."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted and v is not None})
