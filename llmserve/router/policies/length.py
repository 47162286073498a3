"""`length`: prompt-length buckets: each backend declares the prompt lengths it takes; least outstanding
inside the bucket."""

from __future__ import annotations

from .base import Backend, Decision, Policy, RouteRequest

REASON_LENGTH = "length"
REASON_LENGTH_FALLBACK = "length_fallback"


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
