"""`round_robin`: each backend in turn."""

from __future__ import annotations

from .base import Backend, Decision, Policy, RouteRequest

REASON_ROUND_ROBIN = "round_robin"


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
