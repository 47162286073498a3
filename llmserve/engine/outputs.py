"""What one engine step passes between its parts (no tensors, no model: the scheduler imports this).

Scheduler.schedule()            -> SchedulerOutput   which requests run, how many tokens each
ModelRunner.execute             -> SampledTokens     per request: its sampled tokens (or hidden states)
Scheduler.update_from_output    -> AppendedTokens    per request that sampled: how many tokens it took
OutputProcessor.process         -> TextStep          per such request: its new text, a stop string found
Scheduler.apply_text            <- TextStep          stops (or fails) the requests whose text decided so
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from llmserve.engine.request import Request, TokenLogprobs


@dataclass
class SchedulerOutput:
    # request_id -> number of tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    new_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # request_id -> number of speculative tokens (beyond the first) scheduled for verification
    num_spec_tokens: dict[str, int] = field(default_factory=dict)
    # the KV cache manager's tables for the step (KVCacheManager.fill_tables): what the runner reads
    block_ids: dict[str, list[int]] = field(default_factory=dict)  # request_id -> its blocks in the main pool
    window_tables: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # ... in the window pool
    state_slots: dict[str, int] = field(default_factory=dict)  # ... its recurrent state slot
    # (source, destination) block ids to copy in every layer before the step: a request's own copy of a cached
    # block that holds its last prompt token (the one it computes; KVCacheManager.get_computed_blocks)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def __bool__(self) -> bool:
        return bool(self.num_scheduled_tokens)


@dataclass
class SampledTokens:
    """What the runner sampled for one request that reached the end of its known tokens: one token
    per logits row, i.e. its next token, or with k speculative proposals k + 1 tokens (the model's
    pick after each verified position; a sampled request: the proposals rejection sampling accepted and
    the model's token after them). If sampling failed at a row, the tokens before it and `error`."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # one per token, when the request asks for them
    error: BaseException | None = None
    # a pooling request (embeddings) samples nothing: its hidden states joined its sum (engine/pooling.py);
    # once its whole prompt is computed, its normalized vector
    pooling: bool = False
    embedding: list[float] | None = None


class AppendedTokens(NamedTuple):
    """A request that sampled this step and how many tokens it appended (0: it failed or pooled)."""

    request: Request
    num_tokens: int


@dataclass
class TextStep:
    """One request's text this step: its new token ids and text; `stop`: a stop string found, ending its
    output at that many tokens (the tokens after it dropped); `error`: detokenizing failed."""

    request: Request
    new_ids: list[int] = field(default_factory=list)
    delta: str = ""
    stop: tuple[str, int] | None = None
    error: BaseException | None = None
