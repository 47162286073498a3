"""Requests' progress -> RequestOutputs: incremental detokenization and stop strings.

`Scheduler.update_from_output` has appended a step's tokens and finished the requests that stop on a
token (EOS, stop token ids, max_tokens, max_model_len, a complete grammar). A stop string can only be
seen in text, so it is found here, token by token: the request then stops at the token that completed
it: `process` returns that decision (`TextStep.stop`) and the engine hands it to `Scheduler.apply_text`,
before `outputs` makes the RequestOutputs. The text a request streams always equals its final text.
"""

from __future__ import annotations

from llmserve.engine.outputs import AppendedTokens, TextStep
from llmserve.engine.request import CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus
from llmserve.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # request id -> its detokenizer

    def add_request(self, req: Request) -> None:
        p = req.params
        self.detokenizers[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, p.stop, p.skip_special_tokens, p.include_stop_str_in_output
        )

    def process(self, appended: list[AppendedTokens]) -> list[TextStep]:
        """Detokenize what each request appended this step; a stop string found (or a failure) comes back
        as the step's decision, for the scheduler to apply before `outputs`."""
        steps = []
        for req, n in appended:
            try:
                steps.append(self._process(req, n))
            except Exception as e:  # noqa: BLE001 - one request's fault must not stop the others
                steps.append(TextStep(req, error=e))
        return steps

    def _process(self, req: Request, n: int) -> TextStep:
        if req.status == RequestStatus.FINISHED_ERROR:
            return TextStep(req)
        detok = self.detokenizers[req.request_id]
        before = req.num_output_tokens - n
        new_ids = req.output_token_ids[before:]
        delta = ""
        for j, token in enumerate(new_ids):
            # the scheduler finishes a request only at the last token it appends
            finished = req.is_finished and j == n - 1
            eos = finished and req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None
            delta += detok.add([] if eos else [token], finished=finished)  # EOS has no text
            if detok.stopped is not None and before + j + 1 >= req.params.min_tokens:
                return TextStep(req, new_ids[: j + 1], delta, stop=(detok.stopped, before + j + 1))
        return TextStep(req, new_ids, delta)

    def outputs(self, steps: list[TextStep]) -> list[RequestOutput]:
        """One output per request of the step, once the scheduler has applied the steps' decisions."""
        outputs = []
        for t in steps:
            req = t.request
            new_lps = req.logprobs[len(req.logprobs) - len(t.new_ids) :] if req.params.logprobs is not None else None
            outputs.append(self.output(req, t.new_ids, t.delta, new_lps))
        return outputs

    def output(self, req: Request, new_ids=(), delta: str = "", new_lps=None) -> RequestOutput:
        """The request's output so far, with what this step added; a finished request is forgotten."""
        detok = self.detokenizers.get(req.request_id)
        comp = CompletionOutput(
            index=0,
            text=detok.output_text if detok else "",
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            delta_text=delta,
            delta_token_ids=list(new_ids),
            delta_logprobs=new_lps,
        )
        if req.is_finished:
            self.detokenizers.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=req.is_finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=RequestMetrics(
                req.arrival_time,
                req.first_scheduled_time,
                req.first_token_time,
                req.last_token_time,
                req.finished_time,
                req.num_preemptions,
            ),
            error=req.error,
            embedding=req.embedding,
            prompt_logprobs=[None, *req.prompt_logprobs] if req.params.prompt_logprobs is not None else None,
        )
