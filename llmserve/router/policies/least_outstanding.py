"""`least_outstanding`: fewest in-flight requests (divided by weight); optionally the power of two
choices: sample two backends at random and take the less loaded one."""

from __future__ import annotations

import random

from .base import REASON_LEAST_LOADED, Backend, Decision, Policy, RouteRequest


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
