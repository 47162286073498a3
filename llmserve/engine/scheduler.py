"""Scheduling policy: which requests run this step, and how many tokens each.

vLLM V1's rule: there is no prefill or decode phase. Every request has `num_computed_tokens`; each
step hands out a token budget (`max_num_batched_tokens`) to running requests first, then to waiting
ones (up to `max_num_seqs` running). Chunked prefill, prefix-cache hits and decode all follow from it.
When the KV pool runs out, the lowest-priority running request is preempted (its blocks are freed
and it is recomputed later) instead of failing with out-of-memory.

After the step, `update_from_output` is where its results change the requests: `num_computed_tokens`
advances, sampled tokens are appended, stop conditions that need no text finish requests (EOS, stop
token ids, max_tokens, max_model_len, a complete grammar) and rejected speculative tokens are rolled
back. Stop strings need text: the output processor finds them and `apply_text` stops the requests.

Pure policy and bookkeeping: no tensors, no model, no tokenizer.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.outputs import AppendedTokens, SampledTokens, SchedulerOutput, TextStep
from llmserve.engine.request import Request, RequestStatus, TokenLogprobs
from llmserve.engine.step_budget import StepBudget
from llmserve.model.vision.inputs import whole_images

log = logging.getLogger("llmserve.scheduler")


# A CPU step's prefill work when --max-num-batched-tokens is not given: about 0.7 s of float32 GEMM per AVX2
# thread (~95 GFLOP/s each). Every decoding request waits through a step, so its length is the ITL's tail; chunks
# much smaller than 128 tokens pay the step's fixed cost (reading every weight, the Python around it) too often.
CPU_STEP_FLOPS_PER_THREAD = 2**36
CPU_MIN_CHUNK, CPU_MAX_CHUNK = 128, 2048


def default_token_budget(flops_per_token: int, device_type: str, threads: int, min_run: int = 0) -> int:
    """The step's token budget when none is given: 2048 on CUDA (vLLM's); on CPU, the power of two of tokens whose
    projections fit a step's share of work (CPU_STEP_FLOPS_PER_THREAD per thread), within [128, 2048] and at least
    `min_run` (a run of tokens that must be computed in one step: Gemma 3's image). The bundled 135M model on 2
    threads gets 512; a 1B model 128 (BENCHMARKS.md: same throughput, p99 ITL and TTFT lower than with 512)."""
    if device_type == "cuda":
        return max(2048, min_run)
    fit = CPU_STEP_FLOPS_PER_THREAD * max(1, threads) // max(1, flops_per_token)
    budget = max(min_run, min(CPU_MAX_CHUNK, max(CPU_MIN_CHUNK, 1 << max(0, fit.bit_length() - 1))))
    log.info(
        "max_num_batched_tokens %d by default (%.2f GFLOP a token, %d threads; --max-num-batched-tokens sets it)",
        budget,
        flops_per_token / 1e9,
        threads,
    )
    return budget


def alone_token_budget(budget: int, device_type: str, given: bool) -> int:
    """The tokens of a step with no decoding row: prompts alone, whose step nobody waits through for a next token.
    The token budget itself when --max-num-batched-tokens is given or on CUDA; on CPU's default, at least
    CPU_MAX_CHUNK: the small default chunk bounds the steps that carry decoding rows (their gaps), and a prompt alone
    in 128-token chunks reads every weight once a chunk (3B bf16, 1,000 tokens cold: 4.3 s in chunks of 128, 3.5 s
    in one step)."""
    return budget if given or device_type == "cuda" else max(budget, CPU_MAX_CHUNK)


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queued_requests`; the server answers 429."""


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        max_queued_requests: int | None = None,
        max_step_ms: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        alone_tokens: int | None = None,
    ) -> None:
        self.kv = kv
        self.step_budget = StepBudget(max_step_ms, max_num_batched_tokens, alone_tokens)
        self._clock = clock
        self._step_started: tuple[float, int] | None = None  # (clock, tokens) of the step being computed
        self._step_ended: tuple[float, int, float] | None = None  # (clock at its start, tokens, clock at its end)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.max_queued_requests = max_queued_requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_spec_proposed = 0  # speculative decoding: tokens proposed and accepted by verification
        self.num_spec_accepted = 0
        self.num_spec_drafts = 0
        self.fault_hook = None  # tests: called with each request before its token is appended

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
        started = self._clock()
        if self._step_ended is not None:  # the last step's cost, for the step-time budget
            began, tokens, ended = self._step_ended
            # with requests still running the loop came straight back: a stream's gap between tokens is the whole
            # period, the engine's work after the step (detokenizing, stop strings, outputs) included; after an
            # idle wait, the step itself
            period = (started if self.running else ended) - began
            if log.isEnabledFor(logging.DEBUG):  # (--log-level debug: what the step-time budget sees, step by step)
                c = self.step_budget.cost
                predicted = "unfitted" if c.per_token is None else f"{c.fixed + c.per_token * tokens:.3f} s"
                log.debug(
                    "step: %d tokens, %.3f s, period %.3f s (predicted %s); running %d, waiting %d, preemptions %d",
                    *(tokens, ended - began, period, predicted),
                    *(len(self.running), len(self.waiting), self.num_preemptions),
                )
            self.step_budget.observe(tokens, period)
            self._step_ended = None
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        out = self._schedule(self.step_budget.budget(sum(1 + len(r.spec_token_ids) for r in decoding)), decoding)
        self.kv.fill_tables(out)  # the block tables the runner reads
        self._step_started = (started, sum(out.num_scheduled_tokens.values()))
        return out

    def _schedule(self, budget: int, decoding: list[Request]) -> SchedulerOutput:
        out = SchedulerOutput()
        now = time.time()

        # 1. running requests: the decoding ones first (their gap is the step), then in rank order, each as many
        # tokens as it has uncomputed
        first = {id(r) for r in decoding}
        for request in sorted(self.running, key=lambda r: (id(r) not in first, self._rank(r))):
            if budget <= 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            spec = request.spec_token_ids
            num_new = request.num_tokens - request.num_computed_tokens
            if spec and num_new == 1:
                num_new += len(spec)
            num_new = min(num_new, budget, self.max_model_len - request.num_computed_tokens)
            if request.images:  # a bidirectional image's run is computed in one chunk
                num_new = whole_images(request.images, request.num_computed_tokens, num_new, budget)
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
            # a pooling request computes every position (mean pooling reads all their hidden states), and so
            # does one that asks for prompt logprobs (a cached block has no logits): no prefix cache look-up
            full = request.params.pooling is not None or request.needs_prompt_logprobs
            if request.num_computed_tokens == 0 and not full:
                computed, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if request.images:
                num_new = whole_images(request.images, request.num_computed_tokens + num_cached, num_new, budget)
                if num_new <= 0:
                    break  # its image's run does not fit the rest of this step's budget
            if self.kv.allocate_slots(request, num_new, computed) is None:
                if self.policy == "priority" and self._preempt_for(request, out):
                    continue  # freed blocks: try again
                break
            self.waiting.remove(request)
            if request.num_cached_tokens < 0:  # its first schedule (not a preempted request's return)
                request.num_cached_tokens = num_cached
                if not full:
                    self.kv.count_prefix_hits(request, num_cached)
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

    # -- after the step -----------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: list[SampledTokens]) -> list[AppendedTokens]:
        """Apply a step's results: every request that ran has computed its scheduled tokens; each one
        that sampled gets its token appended, or with proposals the longest verified run of them and
        the model's token after it (positions past that run are rolled back and recomputed next step).
        A request whose token fails (sampling error, grammar, fault hook) fails alone.
        Returns (request, number of tokens appended) for the requests that sampled, in batch order."""
        if self._step_started is not None:  # (its cost is read at the next schedule(): the whole period)
            started, tokens = self._step_started
            self._step_ended = (started, tokens, self._clock())
            self._step_started = None
        for request in out.requests:
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
        now = time.time()
        appended = []
        for s in sampled:
            r = s.request
            if s.pooling:  # an embedding: it finishes once its whole prompt is computed, its blocks freed at once
                if s.embedding is not None:
                    r.embedding = s.embedding
                    self.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
                    appended.append(AppendedTokens(r, 0))
                continue
            proposals = r.spec_token_ids[: out.num_spec_tokens.get(r.request_id, 0)]
            r.spec_token_ids = []
            n = 0
            try:
                for j, token in enumerate(s.token_ids):
                    if self.fault_hook is not None:
                        self.fault_hook(r)
                    self._append(r, token, s.logprobs[j] if s.logprobs else None, now)
                    n += 1
                    if r.is_finished or j >= len(proposals) or token != proposals[j]:
                        break
                else:
                    if s.error is not None:
                        raise s.error
            except Exception as e:  # noqa: BLE001 - one request's fault must not stop the others
                self.fail_request(r, e)
                appended.append(AppendedTokens(r, n))
                continue
            if proposals:
                self.num_spec_drafts += 1
                self.num_spec_proposed += len(proposals)
                self.num_spec_accepted += n - 1
                # nothing accepted: back off (a sampled request far from what it copies rejects most
                # proposals, and each one costs a verified row)
                r.spec_misses = 0 if n > 1 else r.spec_misses + 1
                r.spec_wait = min(2**r.spec_misses, 16) if r.spec_misses else 0
                if not r.is_finished:  # KV is valid only up to the last verified proposal
                    r.num_computed_tokens -= len(proposals) + 1 - n
            appended.append(AppendedTokens(r, n))
        return appended

    def _append(self, request: Request, token: int, lp: TokenLogprobs | None, now: float) -> None:
        """Append one token; finish the request if it stops there (all but stop strings)."""
        guided = request.guided
        if guided is not None and not guided.accept(token):
            raise RuntimeError(f"guided decoding: token {token} is not allowed by the grammar")
        request.append_token(token)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        if lp is not None:
            request.logprobs.append(lp)
            request.cumulative_logprob += lp.logprob
        p = request.params
        status = None
        if token in request.eos_token_ids and request.num_output_tokens > p.min_tokens - 1:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif token in p.stop_token_ids:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif p.max_tokens is not None and request.num_output_tokens >= p.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        elif request.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if guided is not None and guided.finished and status != RequestStatus.FINISHED_STOPPED:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None  # the grammar is complete
        if status is not None:
            self.finish_request(request.request_id, status)

    def apply_text(self, steps: list[TextStep]) -> None:
        """The output processor's decisions: a request whose text met a stop string stops there; one
        whose detokenizing failed fails."""
        for t in steps:
            if t.error is not None:
                self.fail_request(t.request, t.error)
            elif t.stop is not None:
                self.stop_request(t.request, *t.stop)

    def stop_request(self, request: Request, stop: str, num_output_tokens: int) -> None:
        """A stop string ends the request's text at output token `num_output_tokens` (the output processor
        found it): the request stops there. Tokens appended after it in this step (verified speculative
        ones) are dropped, and not counted as accepted."""
        extra = request.num_output_tokens - num_output_tokens
        if extra > 0:
            del request.output_token_ids[num_output_tokens:]
            del request.all_token_ids[request.num_prompt_tokens + num_output_tokens :]
            if request.logprobs:
                del request.logprobs[num_output_tokens:]
                request.cumulative_logprob = sum((lp.logprob for lp in request.logprobs), 0.0)
            self.num_spec_accepted -= extra
        self._finish_now(request, RequestStatus.FINISHED_STOPPED)
        request.stop_reason = stop

    def fail_request(self, request: Request, error: BaseException) -> None:
        """Finish one request with an error; its blocks go back to the pool at once."""
        log.error("request %s failed: %r", request.request_id, error)
        request.error = f"{type(error).__name__}: {error}"
        self._finish_now(request, RequestStatus.FINISHED_ERROR)

    def _finish_now(self, request: Request, status: RequestStatus) -> None:
        # also for a request that this step has just finished otherwise: the later reason wins
        if self.finish_request(request.request_id, status) is None:
            request.status = status
