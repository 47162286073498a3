"""The server's one piece of state: its settings (ServerSettings, llmserve/config.py), the engine (loaded
in the background), the metrics, readiness, the reasoning parser, the checks every API's routes start
with (the engine ready, the model served) and the record of each finished engine request (metrics and
the request log line). Routes get the state as the `State` dependency."""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from typing import Annotated

from fastapi import Depends, Request

from llmserve import envs
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.request import RequestOutput
from llmserve.model.loader.build import release_freed_memory
from llmserve.serve_config import ServerSettings
from llmserve.server import tool_parsers
from llmserve.server.batch_store import BatchStore
from llmserve.server.errors import APIError
from llmserve.server.faults import install_fault_injection
from llmserve.server.metrics import ServerMetrics
from llmserve.server.reasoning import ReasoningParser
from llmserve.server.request_log import RequestLog
from llmserve.server.tracing import make_tracer

log = logging.getLogger("llmserve.server")
req_log = logging.getLogger("llmserve.requests")


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.api_keys = settings.api_keys()  # --api-key's and --api-key-file's (read once, at start-up)
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.metrics: ServerMetrics | None = None
        self.model_names: list[str] = []
        self.draining = False
        self.models = None  # --models-dir: the ModelPool (server/models_dir.py), on the front state
        self.slot = None  # --models-dir: this model's Slot in it
        self.on_fatal = None  # set by the CLI: called when the process should exit non-zero
        self.reasoning = ReasoningParser.from_name(
            settings.reasoning_parser, settings.reasoning_start_marker, settings.reasoning_end_marker
        )
        # the tool-call format: --tool-call-parser, else chosen from the chat template once the model loads
        self.tool_parser = tool_parsers.get_parser(settings.tool_call_parser) if settings.tool_call_parser else None
        self.chat_template = read_chat_template(settings.chat_template)
        self.tracer = make_tracer(settings.otlp_traces_endpoint)  # --otlp-traces-endpoint, else None
        self.request_log = RequestLog(settings.log_requests) if settings.log_requests else None  # --log-requests
        # the Files and Batches APIs' state (--batch-dir), batches run at most half max_num_seqs at a time
        self.batches = (
            BatchStore(settings.batch_dir, settings.max_batch_file_bytes, settings.engine.max_num_seqs // 2)
            if settings.batch_dir
            else None
        )

    @property
    def ready(self) -> bool:
        if self.models is not None:  # the front of --models-dir: ready to list and load models
            return not self.draining
        e = self.engine
        if e is None or e.dead is not None or self.draining:
            return False
        return time.time() - e.last_progress < self.settings.ready_stall_seconds

    def engine_or_503(self) -> AsyncEngine:
        """The engine, or a 503 (with Retry-After) while it loads, drains or has stalled."""
        if not self.ready:
            raise APIError(
                503,
                "the model is not ready yet" if self.engine is None else "the server is not ready",
                code="not_ready",
                headers={"Retry-After": "5"},
            )
        return self.engine

    def check_model(self, name: str | None) -> str:
        """The model a request names: the base model (also when it names none) or a loaded LoRA adapter."""
        if name and name not in self.model_names:
            if self.lora_name(name):
                return name
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {', '.join(self.served_names())}",
                param="model",
                code="model_not_found",
            )
        return self.model_names[0]

    def load(self) -> None:
        try:
            engine = AsyncEngine.from_config(self.settings.engine)
        except BaseException as e:  # noqa: BLE001 - reported, and the process exits non-zero
            log.error("model failed to load: %s", e)
            self.load_error = e
            if self.on_fatal:
                self.on_fatal(e)
            return
        name = engine.engine.served_model_name
        self.model_names = list(engine.engine.served_model_names)
        if self.chat_template is not None:
            engine.tokenizer.set_chat_template(self.chat_template)
        if self.tool_parser is None:
            self.tool_parser = tool_parsers.choose(getattr(engine.tokenizer.hf, "chat_template", None))
            log.info("tool calls: the %s parser (from the chat template)", self.tool_parser.name)
        if self.metrics is None:  # (kept across an unload and a new load: the counters go on)
            self.metrics = ServerMetrics(name, lambda: self.engine.engine.stats() if self.engine is not None else None)
        engine.on_dead = self._engine_died
        engine.on_aborted = self._request_aborted
        if envs.LLMSERVE_FAULT_INJECTION:
            install_fault_injection(engine)
        self.engine = engine
        log.info("ready: serving %s", name)

    def unload(self) -> None:
        """Stop the engine and give its memory back (--models-dir: an idle model): the engine thread joined,
        the last references dropped, gc, then malloc_trim so that the process's RSS falls."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        engine.shutdown()
        engine.on_dead = engine.on_aborted = None
        del engine
        gc.collect()
        release_freed_memory()

    def plan_tools(self, tools, tool_choice, parallel_tool_calls=None) -> tool_parsers.ToolPlan | None:
        """A request's tools (tool_parsers.plan) read with the server's tool-call parser; a ValueError for
        "auto" under --no-enable-auto-tool-choice."""
        p = tool_parsers.plan(tools, tool_choice, self.tool_parser, parallel_tool_calls)
        if p is not None and p.choice == "auto" and not self.settings.enable_auto_tool_choice:
            raise tool_parsers.ToolError(
                'tool_choice: "auto" needs --enable-auto-tool-choice (this server runs without it); '
                'send "required", a named function or "none"'
            )
        return p

    @property
    def lora(self):
        """The engine's LoRARegistry (llmserve.engine.lora) with --enable-lora, else None."""
        return None if self.engine is None else self.engine.engine.lora

    def lora_name(self, model: str) -> str | None:
        """`model` if it names a loaded LoRA adapter (not the base model), else None."""
        lora = self.lora
        return model if lora is not None and model not in self.model_names and lora.get(model) else None

    def served_names(self) -> list[str]:
        """Every name a request may send as `model`: the base model's, then the loaded adapters'."""
        return self.model_names + (self.lora.names() if self.lora is not None else [])

    def _request_aborted(self, out: RequestOutput) -> None:
        """A request aborted in the engine (its client went away, or it timed out): counted in
        request_success_total{finished_reason="abort"} as vLLM does, and logged like any other."""
        arrival = out.metrics.arrival_time if out.metrics else time.time()
        self.record_finished(out, len(out.prompt_token_ids), [], arrival)

    def _engine_died(self, e: BaseException) -> None:
        log.error("engine loop died (%r): exiting so that a supervisor restarts the server", e)
        if self.on_fatal:
            self.on_fatal(e)

    def record_finished(self, out: RequestOutput, num_prompt_tokens: int, times: list[float], arrival: float) -> None:
        """Metrics, the request log line and the trace span (--otlp-traces-endpoint) for one finished engine
        request (aborted ones included)."""
        m = self.metrics
        if m is not None:
            m.token_times(arrival, times)
            m.finished(out, num_prompt_tokens)
        met = out.metrics
        comp = out.outputs[0]
        # the first token as the client got it; an aborted request has no stream's times: the engine's own
        first = times[0] if times else (met.first_token_time if met and comp.token_ids else None)
        fields = {
            "request_id": out.request_id,
            "prompt_tokens": num_prompt_tokens,
            "output_tokens": len(comp.token_ids),
            "cached_tokens": out.num_cached_tokens,
            "queue_time": round((met.first_scheduled_time or met.arrival_time) - met.arrival_time, 4) if met else None,
            "ttft": round(first - met.arrival_time, 4) if met and first is not None else None,
            "total_time": round((met.finished_time or time.time()) - met.arrival_time, 4) if met else None,
            "finish_reason": comp.finish_reason,
            "preemptions": met.num_preemptions if met else 0,
        }
        if self.tracer is not None:
            try:
                self.tracer.finish(out, num_prompt_tokens, self.model_names[0] if self.model_names else None)
            except Exception:  # noqa: BLE001 - tracing must not break accounting
                log.exception("could not record the request's span")
        if self.settings.log_prompts:
            fields["prompt"] = out.prompt
            fields["completion"] = comp.text
        req_log.info(json.dumps(fields))


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template (holds Jinja's `{{` or
    `{%`); a ValueError for anything else."""
    if not value:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja chat template")


async def server_state(request: Request) -> ServerState:
    """The app's ServerState; with --models-dir, that of the model the request's body names (loaded first)."""
    state = request.app.state.llm
    if state.models is None:
        return state
    return await state.models.state_for(request)


# a route's parameter `state: State` is the app's ServerState
State = Annotated[ServerState, Depends(server_state)]
