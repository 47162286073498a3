"""The step-time budget (`--max-step-ms`): how many tokens a step may take while requests are decoding.

Every decoding request waits through a whole step for its next token, and through the engine's work after it
(detokenizing, stop strings, outputs), so the loop's period from one schedule() to the next is the stream's
inter-token gap: that is what the scheduler times (the step alone after an idle wait). A chunk budget in tokens
cannot bound it: 128 prompt tokens are 0.1 s on the bundled model and 7-10 s at 8B on two cores. This model learns
the step's cost from the steps themselves, as a fixed part (reading the weights, the Python around the model) plus a
part per token, and gives a step with decoding rows the tokens that fit the target time: the decode rows first, then
a prefill chunk of what is left (at least `MIN_PREFILL` tokens, so a prompt always moves). A step with no decoding
row takes the budget of prompts alone (`alone_tokens`: on CPU's default at least 2048, scheduler.alone_token_budget):
a long prompt alone prefills at full speed.

The fit is least squares over the recent steps (each older step weighing `DECAY` times less), so it follows a
machine whose speed drifts. Until the steps have varied enough in size to tell the two parts apart, a step with
decoding rows takes the full token budget and half of it in turn (a server loaded from its first request has every
step at the full budget, and without this would never learn the cost: 64 prompts at once at 8B ran 2.4 s steps
throughout); once fitted, steps of one size (a loaded server's, all cut to the target) scale the fit to their level.
Pure arithmetic on (tokens, seconds) pairs: the scheduler times its steps with its clock.
"""

from __future__ import annotations

import logging

log = logging.getLogger("llmserve.scheduler")

# the default target on CPU: the steps' mean, set so that with a 2-core VM's noise (one step in a hundred 10-15% over
# its fit) the p99 gap between a stream's tokens stays under a second at any model size (8B, 16 streams: 0.98-1.00 s;
# 1000 ms: 1.13-1.22 s)
CPU_STEP_MS = 850.0
DECAY = 0.9  # an observation's weight falls by this each later step (~10 steps of memory)
MIN_PREFILL = 8  # prompt tokens a step with decoding rows still takes when the decode rows alone fill the target
MIN_SPREAD = 4.0  # tokens: the weighted spread of step sizes needed before the per-token cost is trusted


def resolve_max_step_ms(max_step_ms: float | None, device_type: str) -> float | None:
    """--max-step-ms as given; unset: CPU_STEP_MS on CPU, none on CUDA (a GPU's steps are short). 0: no target."""
    if max_step_ms is None:
        return CPU_STEP_MS if device_type == "cpu" else None
    return max_step_ms or None


class StepCost:
    """Seconds a step of n tokens takes, `fixed + per_token * n`, fitted to the steps observed."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.fixed: float | None = None
        self.per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        d = DECAY
        self._w = self._w * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        slope = (self._xy / self._w - mx * my) / var if var >= MIN_SPREAD**2 else 0.0
        if slope <= 0:
            # steps of one size (the two parts cannot be told apart) or noise: the fit keeps its shape and scales to
            # the recent steps' level. Under load every step is cut to the target's size, and a machine that slowed
            # down must still be seen (a fit left as it was kept 8B steps 15-20% over the target for minutes)
            if self.per_token is not None and my > 0:
                scale = my / (self.fixed + self.per_token * mx)  # (every part costs `scale` times what it did)
                self.fixed *= scale
                self.per_token *= scale
            return
        self.per_token = slope
        self.fixed = max(0.0, my - slope * mx)

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step of at most `seconds` holds, or None while the cost is unknown."""
        if self.per_token is None:
            return None
        return max(0, int((seconds - self.fixed) / self.per_token))


class StepBudget:
    """The token budget of each step under a target step time (`max_step_ms`; None or 0: tokens only)."""

    def __init__(self, max_step_ms: float | None, max_num_batched_tokens: int, alone_tokens: int | None = None) -> None:
        self.target = max_step_ms / 1000.0 if max_step_ms else None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.alone_tokens = alone_tokens or max_num_batched_tokens  # a step with no decoding row
        self.cost = StepCost()
        self._logged = False
        self._half = False  # the next unfitted step with decoding rows takes half the token budget

    def budget(self, decode_tokens: int) -> int:
        """Tokens for a step whose running requests decode `decode_tokens` tokens (proposals included)."""
        if decode_tokens == 0:
            return self.alone_tokens
        if self.target is None:
            return self.max_num_batched_tokens
        fit = self.cost.tokens_within(self.target)
        if fit is None:  # not fitted yet: full and half steps in turn, so that their sizes differ
            self._half = not self._half
            if self._half:
                return min(
                    self.max_num_batched_tokens, max(decode_tokens + MIN_PREFILL, self.max_num_batched_tokens // 2)
                )
            return self.max_num_batched_tokens
        if not self._logged:
            self._logged = True
            log.info(
                "step-time budget: %.0f ms a step while decoding (%.1f ms fixed + %.2f ms a token measured): "
                "%d tokens a step",
                self.target * 1000,
                self.cost.fixed * 1000,
                self.cost.per_token * 1000,
                fit,
            )
        return min(self.max_num_batched_tokens, max(fit, decode_tokens + MIN_PREFILL))

    def observe(self, tokens: int, seconds: float) -> None:
        # a step of prompts alone past the token budget is not one the budget sizes, and a long chunk's tokens cost
        # less each (a 2048-token GEMM's rate): fitted in, it would make the mixed steps after it run over the target
        if self.target is not None and 0 < tokens <= self.max_num_batched_tokens:
            self.cost.observe(tokens, seconds)
