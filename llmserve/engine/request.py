"""Requests as the engine sees them: status, finish reasons, outputs (and, re-exported from
`llmserve.sampling_params`, the sampling parameters)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmserve.sampling_params import Logprob, SamplingParams, TokenLogprobs  # noqa: F401 (re-exported)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    """One sequence in the engine. The scheduler reads token counts; the runner reads tokens."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids or ())
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache (first schedule)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.pooled_sum = None  # a pooling request: the sum of its final hidden states so far
        self.embedding: list[float] | None = None  # ... and its normalized vector when the prompt is done
        self.logprobs: list[TokenLogprobs] = []
        # SamplingParams.prompt_logprobs: entry i is prompt token i + 1's (engine/prompt_logprobs.py)
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.cumulative_logprob = 0.0
        self.block_hashes: list = []  # chained hashes of full blocks, filled by KVCacheManager
        self.block_digests: list[bytes] = []  # ... their names outside the process (kv_events.chain_digests)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.spec_token_ids: list[int] = []  # speculative proposals for the next step
        self.spec_draft_probs: list | None = None  # a draft model's distribution per proposal (sampled requests)
        self.spec_misses = 0  # verifications in a row that accepted nothing ...
        self.spec_wait = 0  # ... and the steps to decode plainly before proposing again (2, 4, ... 16)
        self.generator = None  # torch.Generator of a seeded request (set by the engine)
        self.guided = None  # GuidedMatcher (engine/guided.py) of a guided request
        self.lora = None  # LoRAAdapter (model/lora.py) of a request for an adapter
        # vision-language models: the prompt's images (llmserve.model.vision.ImageInput), in prompt order; their
        # tower outputs are kept on them until the request ends
        self.images: list = []
        # multimodal rotary (Qwen2.5-VL): the prompt's [3, prompt] positions and the offset of the tokens after it
        self.mrope: tuple | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def next_token_is_argmax(self) -> bool:
        """Greedy and nothing changes the logits: no penalties, grammar or banned tokens (EOS before
        min_tokens). Such a request can take the model's argmax as is, and can be speculated."""
        p = self.params
        return p.greedy and not p.needs_penalties and not p.guided and self.num_output_tokens >= p.min_tokens

    @property
    def can_speculate(self) -> bool:
        """Only temperature, top-k, top-p and min-p shape its next-token distribution (no penalties, grammar
        or banned tokens), so k proposals can be verified in one forward: greedy ones by equality with the
        argmax, sampled ones by rejection sampling (model/rejection.py)."""
        p = self.params
        return not p.needs_penalties and not p.guided and self.num_output_tokens >= p.min_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and has not got them all: its prompt is computed in full (no prefix
        cache hit: a cached block has no logits), and a recomputation after preemption starts them again."""
        p = self.params.prompt_logprobs
        return p is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # what this step added (for streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    embedding: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling)
    # SamplingParams.prompt_logprobs: one per prompt token, the first None (it has no prefix), as vLLM's
    prompt_logprobs: list[TokenLogprobs | None] | None = None
