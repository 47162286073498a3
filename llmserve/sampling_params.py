"""Sampling parameters and logprob records.

Shared by the engine (requests carry them) and the model layer (the sampler reads them), so that neither
imports the other: this module imports nothing of llmserve. `llmserve.engine.request` re-exports them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# the guided decoding fields that hold a value (guided_json_object is a flag)
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_structural_tag")


@dataclass
class SamplingParams:
    """How to sample one completion. Names and defaults follow vLLM's `SamplingParams`."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # the last N tokens (prompt and output) repetition_penalty looks at (llama.cpp's and Ollama's repeat_last_n);
    # None: all of them, as vLLM
    repetition_last_n: int | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    # token id -> a value added to its logit before sampling (greedy too), in [-100, 100]: -100 bans the token,
    # +100 all but forces it (OpenAI's logit_bias; the server checks the ids against the vocabulary)
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the chosen one)
    # vLLM's prompt log-probabilities: each prompt token's logprob given the tokens before it (the first has
    # none) and the top-N at its position (0: only the token's own); computed in the prefill (engine/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # guided decoding (structured output), at most one of these; see docs/structured-output.md
    guided_json: dict | str | None = None  # a JSON schema (dict or JSON text)
    guided_json_object: bool = False  # any JSON object (response_format json_object)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None  # the output is exactly one of these strings
    guided_grammar: str | None = None  # an EBNF (GBNF) grammar, rule `root`
    # free text until a trigger, then a tag's JSON schema (JSON text: {"structures": [{"begin", "schema",
    # "end"}], "triggers": [...]}; strict tools under tool_choice auto)
    guided_structural_tag: str | None = None
    # embeddings: "mean" or "last" pools the prompt's final hidden states (normalized) into
    # RequestOutput.embedding and samples nothing
    pooling: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k in (-1, None):
            self.top_k = 0
        self.logit_bias = _logit_bias(self.logit_bias)
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}")

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            finite(name, getattr(self, name))
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        n = self.repetition_last_n
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise bad("repetition_last_n", f"must be None (all tokens) or an integer >= 1, got {n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        # their upper bound is the engine's --max-logprobs (LLMEngine.validate_prompt)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", f"must be an integer >= 0, got {self.prompt_logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.pooling not in (None, "mean", "last"):
            raise bad("pooling", f"must be mean or last, got {self.pooling!r}")
        self._check_guided(bad)

    def _check_guided(self, bad) -> None:
        given = [n for n in GUIDED_FIELDS if getattr(self, n) is not None] + (
            ["guided_json_object"] if self.guided_json_object else []
        )
        if len(given) > 1:
            raise bad(given[1], f"only one guided decoding constraint per request, got {', '.join(given)}")
        if self.guided_json is not None and not isinstance(self.guided_json, (dict, str, bool)):
            raise bad("guided_json", f"must be a JSON schema (an object or its JSON text), got {self.guided_json!r}")
        for name in ("guided_regex", "guided_grammar", "guided_structural_tag"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(name, f"must be a non-empty string, got {v!r}")
        if self.guided_choice is not None:
            if (
                isinstance(self.guided_choice, str)
                or not self.guided_choice
                or any(not isinstance(c, str) or not c for c in self.guided_choice)
            ):
                raise bad("guided_choice", "must be a non-empty list of non-empty strings")
            self.guided_choice = list(self.guided_choice)

    @property
    def guided(self) -> bool:
        return any(getattr(self, n) is not None for n in GUIDED_FIELDS) or self.guided_json_object

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        """Something beside temperature and the top-k/p filters changes its logits: a penalty or a logit bias
        (the sampler's `apply_penalties`; such a row never takes the model's argmax as is, nor speculates)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )

    def clone(self, **changes: Any) -> "SamplingParams":
        values = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)


MAX_LOGIT_BIAS = 100.0


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias} from OpenAI's logit_bias (JSON keys are strings), each bias in [-100, 100]."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias: must be an object of token id -> bias, got {bias!r}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: keys must be token ids, got {key!r}") from None
        if token < 0 or isinstance(key, bool):
            raise ValueError(f"logit_bias: keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"logit_bias: the bias of token {token} must be a number, got {value!r}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {value}")
        out[token] = float(value)
    return out


@dataclass
class Logprob:
    token_id: int
    logprob: float
    decoded: str = ""
    rank: int | None = None  # 1: the most likely token at its position (set for prompt logprobs)


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-N alternatives at one position."""

    token_id: int
    logprob: float
    top: list[Logprob] = field(default_factory=list)
    rank: int | None = None  # the token's rank in the vocabulary at its position, 1-based (prompt logprobs)
