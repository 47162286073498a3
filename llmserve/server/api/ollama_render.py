"""Ollama's answers to a generation (api/ollama.py's rendering): /api/chat and /api/generate as one JSON object or
NDJSON lines (a line per piece of text, then the `done` line with `done_reason` and the counts and durations, in
nanoseconds, as Ollama reports them), and /api/embed's and /api/embeddings' vectors. (What it says of the models:
ollama_models.py.)"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from llmserve.engine.request import RequestOutput
from llmserve.server.api.chat import chat_logprobs
from llmserve.server.errors import APIError
from llmserve.server.rendering import ChoiceText, Rendering

NDJSON = "application/x-ndjson"


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return max(0, int((seconds or 0.0) * 1e9))


def _line(d: dict) -> str:
    return json.dumps(d, ensure_ascii=False) + "\n"


def ollama_tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's tool calls (arguments a JSON string) in Ollama's shape (arguments an object)."""
    out = []
    for c in calls:
        f = c["function"]
        try:
            args = json.loads(f["arguments"])
        except (TypeError, json.JSONDecodeError):
            args = {}
        out.append({"function": {"name": f["name"], "arguments": args}})
    return out


class OllamaRendering(Rendering):
    """/api/chat (`message`) or /api/generate (`response`, `thinking`, `context`): one choice. With
    `logprobs` asked for (`tokenizer` given), each answer's `logprobs`: per token its text, logprob, bytes
    and `top_logprobs`; streamed, a line carries the tokens that came since the last line (text held back
    for a tool call or a reasoning marker: its tokens go with the next line sent)."""

    media_type = NDJSON

    def __init__(
        self, kind: str, model: str, reasoning=None, tool_plan=None, think: bool = True, tokenizer=None, load=0.0
    ) -> None:
        self.kind, self.model = kind, model
        self.load = load  # seconds this request waited for its model to load (--models-dir)
        self.reasoning, self.tool_plan, self.think = reasoning, tool_plan, think
        self.tok = tokenizer
        self.text: ChoiceText | None = None
        self.pending: list = []  # streamed tokens' logprobs not yet sent

    def _logprobs(self, lps) -> list | None:
        return None if lps is None else chat_logprobs(self.tok, lps)["content"]

    def _head(self) -> dict:
        return {"model": self.model, "created_at": now_rfc3339()}

    def _piece(self, content: str, thinking: str = "", calls: list | None = None) -> dict:
        d = self._head()
        if self.kind == "chat":
            msg = {"role": "assistant", "content": content}
            if thinking and self.think:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = ollama_tool_calls(calls)
            d["message"] = msg
        else:
            d["response"] = content
            if thinking and self.think:
                d["thinking"] = thinking
        d["done"] = False
        return d

    def _done(self, gen, out: RequestOutput, d: dict) -> dict:
        c = out.outputs[0]
        prompt, completion, _ = gen.counts()
        m = out.metrics
        start = (m.first_scheduled_time or m.arrival_time) if m else gen.arrival
        first = (m.first_token_time if m else None) or start
        end = (m.finished_time if m else None) or first
        d.update(
            done=True,
            done_reason="length" if c.finish_reason == "length" else "stop",
            total_duration=_ns(max(end, first) - gen.arrival + self.load),
            load_duration=_ns(self.load),
            prompt_eval_count=prompt,
            prompt_eval_duration=_ns(first - start),
            eval_count=completion,
            eval_duration=_ns(end - first),
        )
        if self.kind == "generate":
            d["context"] = list(gen.runs[0][2]) + list(c.token_ids)
        return d

    def body(self, gen) -> dict:
        out = gen.finals[0]
        text = ChoiceText.whole(out.outputs[0].text, self.reasoning, self.tool_plan)
        content, calls = text.calls()
        d = self._piece(content or "", text.reasoning, calls)
        if self.tok is not None and out.outputs[0].logprobs is not None:
            d["logprobs"] = self._logprobs(out.outputs[0].logprobs)
        return self._done(gen, out, d)

    def stream_output(self, gen, i: int, out: RequestOutput) -> list[str]:
        if self.text is None:
            self.text = ChoiceText(self.reasoning, self.tool_plan)
        reasoning, pieces = self.text.feed(out.outputs[0].delta_text, out.finished)
        content = "".join(d.content for d in pieces)
        lines = []
        if content or (reasoning and self.think):
            lines.append(self._piece(content, reasoning))
        if out.finished:
            _, calls = self.text.calls()  # Ollama sends a turn's calls whole, in one message
            if calls:
                lines.append(self._piece("", "", calls))
            lines.append(self._done(gen, out, self._piece("")))
        if self.tok is not None and out.outputs[0].delta_logprobs is not None:
            self.pending += out.outputs[0].delta_logprobs
            if lines:
                lines[0]["logprobs"], self.pending = self._logprobs(self.pending), []
        return [_line(d) for d in lines]

    def stream_error(self, gen, e: APIError) -> list[str]:
        return [_line({"error": e.message})]

    def ping(self) -> str:
        return ""  # NDJSON has no comment line: nothing is sent while waiting


class OllamaEmbedRendering(Rendering):
    """/api/embed (`embeddings`, one per input) or the legacy /api/embeddings (`embedding`, one prompt)."""

    def __init__(self, model: str, legacy: bool = False) -> None:
        self.model, self.legacy = model, legacy

    def body(self, gen) -> dict:
        vectors = [gen.finals[i].embedding for i in sorted(gen.finals)]
        if self.legacy:
            return {"embedding": vectors[0]}
        return {
            "model": self.model,
            "embeddings": vectors,
            "total_duration": _ns(max(o.metrics.finished_time or 0 for o in gen.finals.values()) - gen.arrival)
            if all(o.metrics for o in gen.finals.values())
            else 0,
            "load_duration": 0,
            "prompt_eval_count": gen.counts()[0],
        }
