"""Scheduling policy: which requests run this step, and how many tokens each.

vLLM V1's rule: there is no prefill or decode phase. Every request has `num_computed_tokens`; each
step hands out a token budget (`max_num_batched_tokens`) to running requests first, then to waiting
ones (up to `max_num_seqs` running). Chunked prefill, prefix-cache hits and decode all follow from it.
When the KV pool runs out, the lowest-priority running request is preempted (its blocks are freed
and it is recomputed later) instead of failing with out-of-memory.

Pure policy: no tensors, no model.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queued_requests`; the server answers 429."""


@dataclass
class SchedulerOutput:
    # request_id -> number of tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    new_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # request_id -> number of speculative tokens (beyond the first) scheduled for verification
    num_spec_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def __bool__(self) -> bool:
        return bool(self.num_scheduled_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs",
                 max_queued_requests: int | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.max_queued_requests = max_queued_requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------------
    def num_queued_after(self, extra: int = 0) -> int:
        """How many requests would wait with `extra` more added. Running slots still free take waiting
        requests at the next step, so those do not count: a burst into an idle engine is not refused
        for want of a step that has not run yet."""
        free = max(0, self.max_num_seqs - len(self.running))
        return max(0, len(self.waiting) + extra - free)

    def add_request(self, request: Request) -> None:
        if self.max_queued_requests is not None and self.num_queued_after(1) > self.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_queued_requests} requests)")
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _rank(self, request: Request) -> tuple:
        """Lower ranks run first. fcfs: arrival; priority: (priority, arrival)."""
        if self.policy == "priority":
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    def _next_waiting(self) -> Request:
        if self.policy == "priority":
            return min(self.waiting, key=self._rank)
        return self.waiting[0]

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (abort, stop, fail) a request wherever it is; its blocks go back to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        request.finished_time = time.time()
        self.kv.free(request)
        return request

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the step ------------------------------------------------------------------------------
    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.spec_token_ids = []
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)
        if request.request_id in out.num_scheduled_tokens:
            del out.num_scheduled_tokens[request.request_id]
            out.requests.remove(request)
            out.num_spec_tokens.pop(request.request_id, None)

    def _victim(self) -> Request:
        # The running request that ranks last under the policy.
        return max(self.running, key=self._rank)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()

        # 1. running requests, in rank order, each as many tokens as it has uncomputed
        for request in sorted(self.running, key=self._rank):
            if budget <= 0:
                break
            if request not in self.running:   # preempted earlier in this loop
                continue
            spec = request.spec_token_ids
            num_new = request.num_tokens - request.num_computed_tokens
            if spec and num_new == 1:
                num_new += len(spec)
            num_new = min(num_new, budget, self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._victim()
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            out.num_scheduled_tokens[request.request_id] = num_new
            out.requests.append(request)
            if spec and num_new > 1 and request.num_tokens - request.num_computed_tokens == 1:
                out.num_spec_tokens[request.request_id] = num_new - 1
            budget -= num_new

        # 2. waiting requests, while there is budget, room in the batch and room in the pool
        if out.preempted_request_ids and self.policy != "priority":
            return out  # the pool is under pressure: let running requests drain first
        while self.waiting and budget > 0:
            request = self._next_waiting()
            if len(self.running) >= self.max_num_seqs:
                if self.policy != "priority" or not self._preempt_for(request, out):
                    break
            computed, num_cached = [], 0
            if request.num_computed_tokens == 0 and request.params.pooling is None:
                # (a pooling request computes every position: mean pooling reads all their hidden states)
                computed, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(request, num_new, computed) is None:
                if self.policy == "priority" and self._preempt_for(request, out):
                    continue  # freed blocks: try again
                break
            self.waiting.remove(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            out.requests.append(request)
            out.new_request_ids.append(request.request_id)
            budget -= num_new
        return out

    def _preempt_for(self, request: Request, out: SchedulerOutput) -> bool:
        """Priority policy: preempt the worst running request if it ranks below `request`."""
        if not self.running:
            return False
        victim = self._victim()
        if self._rank(victim) <= self._rank(request):
            return False
        self._preempt(victim, out)
        return True

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance `num_computed_tokens` of every request that ran this step."""
        for request in out.requests:
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
