"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, over the chat machinery.

A request becomes a chat: `system` (a string or text blocks) the system message; each message's text
blocks its content; an assistant's `tool_use` blocks its tool calls and a user's `tool_result` blocks
`tool` turns before its text; earlier `thinking` blocks are dropped (as chat templates drop reasoning).
`tools` (name, description, input_schema) and `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`) go through the chat API's tool machinery (tool_parsers/: calls stream as
input_json_delta as they are written); `output_config.format` (a JSON schema) is guided decoding;
`max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k` are sampling, vLLM's extras too. `thinking`
({"type": "enabled" | "disabled"}) sets the chat template's `enable_thinking`.

The answer is a `message` whose content holds a `thinking` block (with --reasoning-parser), a `text`
block and `tool_use` blocks; stop_reason end_turn, max_tokens, stop_sequence (with the string) or
tool_use; usage as Anthropic counts it (input_tokens excludes the prompt-cache hits, reported as
cache_read_input_tokens). Streamed: message_start, per block content_block_start, its deltas
(text_delta, thinking_delta, input_json_delta), content_block_stop; message_delta with the stop reason
and usage, message_stop; `event: error` on failure, `event: ping` while waiting. Errors on these paths
are in Anthropic's shape (llmserve/errors.py), the 401 of the key check included; the key may come as
`x-api-key` or as a Bearer token.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator

from llmserve.errors import anthropic_error_body
from llmserve.server import protocol as P
from llmserve.server.errors import APIError, from_value_error
from llmserve.server.prepare import chat_images, chat_runs, encode_chat
from llmserve.server.reasoning import ReasoningParser
from llmserve.server.rendering import ChoiceText, Rendering, sse_event
from llmserve.server.serving import Generation
from llmserve.server.state import State
from llmserve.server.tool_parsers import ToolDelta

router = APIRouter()


class AnthropicMessage(P.APIModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class _MessagesFields(P.APIModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict | None:
        kind = (self.thinking or {}).get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            return self.chat_template_kwargs
        return {"enable_thinking": kind != "disabled", **(self.chat_template_kwargs or {})}


class MessagesRequest(_MessagesFields, P.EngineExtras):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=P.MAX_STOP)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        if v is not None and any(not s for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    @property
    def stop(self) -> list[str] | None:
        return self.stop_sequences

    @property
    def response_format(self) -> dict | None:
        """`output_config.format` as the chat API's response_format (what tools.guided_kwargs reads)."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise ValueError('output_config.format: must be {"type": "json_schema", "schema": {...}}')
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


class CountTokensRequest(_MessagesFields):
    pass


class CountTokensResponse(BaseModel):
    input_tokens: int


class MessageObject(BaseModel):
    """The documented shape of a non-streamed answer (for /openapi.json)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: dict[str, Any]


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


ANTHROPIC_ERROR_RESPONSES = {status: {"model": AnthropicErrorResponse} for status in P.ERROR_RESPONSES}


# -- the request as a chat ---------------------------------------------------------------------------------
def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    for k, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise ValueError(f"{where}[{k}]: must be a content block with a type")
    return content


def _block_text(content: Any, where: str) -> str:
    """Text of a string or of text blocks (a system prompt, a tool result)."""
    if content is None:
        return ""
    out = []
    for k, b in enumerate(_blocks(content, where)):
        if b["type"] != "text" or not isinstance(b.get("text"), str):
            raise ValueError(f"{where}[{k}]: blocks of type {b['type']!r} are not supported here (text only)")
        out.append(b["text"])
    return "".join(out)


def _image_url(source: Any, where: str) -> str:
    """An image block's source as a URL: base64 data as a data: URL, or the url source's URL."""
    if isinstance(source, dict) and source.get("type") == "base64":
        if not isinstance(source.get("data"), str) or not isinstance(source.get("media_type"), str):
            raise ValueError(f"{where}: an image's base64 source needs media_type and data")
        return f"data:{source['media_type']};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ValueError(f"{where}: an image's source must be a base64 or url source")


def chat_messages(body: _MessagesFields) -> list[P.ChatMessage]:
    """`system` and `messages` as chat messages; a bad block is a ValueError naming it (messages[1].content[0])."""
    msgs: list[dict] = []
    system = _block_text(body.system, "system")
    if system:
        msgs.append({"role": "system", "content": system})
    for n, m in enumerate(body.messages):
        where = f"messages[{n}].content"
        text, calls, results, parts = [], [], [], []  # parts: text and images in order, where it has images
        for k, b in enumerate(_blocks(m.content, where)):
            kind = b["type"]
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise ValueError(f"{where}[{k}].text: must be a string")
                text.append(b["text"])
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and m.role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), f"{where}[{k}]")}})
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise ValueError(f"{where}[{k}]: a tool_use block needs an id and a name")
                calls.append(
                    {
                        "id": b["id"],
                        "type": "function",
                        "function": {
                            "name": b["name"],
                            "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False),
                        },
                    }
                )
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise ValueError(f"{where}[{k}].tool_use_id: must be a string")
                out = _block_text(b.get("content"), f"{where}[{k}].content")
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": b["tool_use_id"],
                        "content": ("Error: " + out) if b.get("is_error") else out,
                    }
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise ValueError(f"{where}[{k}]: blocks of type {kind!r} are not supported in a {m.role} message")
        msgs.extend(results)
        if text or calls or parts or not results:
            msg = {"role": m.role, "content": "".join(text) if text or not calls else None}
            if len(parts) > len(text):
                msg["content"] = parts
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    return [P.ChatMessage(**m) for m in msgs]


def chat_tools(tools: list[dict] | None, tool_choice: dict | None) -> tuple[list[dict] | None, Any]:
    """Client tools and tool_choice in the chat API's shape (tools.plan validates the rest)."""
    chat = None
    if tools:
        chat = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
                kind = t.get("type") if isinstance(t, dict) else None
                raise ValueError(
                    f"tools[{k}]: only client tools (name, description, input_schema) are supported, got type {kind!r}"
                )
            f = {"name": t.get("name"), "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
            if t.get("description"):
                f["description"] = t["description"]
            chat.append({"type": "function", "function": f})
    if tool_choice is None:
        return chat, None
    kind = tool_choice.get("type")
    if kind in ("auto", "none"):
        return chat, kind
    if kind == "any":
        return chat, "required"
    if kind == "tool" and isinstance(tool_choice.get("name"), str):
        return chat, {"type": "function", "function": {"name": tool_choice["name"]}}
    raise ValueError(
        'tool_choice: must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...}'
    )


# -- the answer ------------------------------------------------------------------------------------------
def _stop(c, calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class MessagesRendering(Rendering):
    """The message object and its stream events (one choice); content blocks are built as the text arrives."""

    def __init__(self, body: MessagesRequest, tool_plan=None, reasoning: ReasoningParser | None = None) -> None:
        self.req = body
        self.mid = f"msg_{uuid.uuid4().hex[:24]}"
        self.text = ChoiceText(reasoning, tool_plan)
        self.blocks: list[dict] = []
        self.open: dict | None = None
        self.calls = 0  # tool_use blocks
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.events: list[str] = []

    def _event(self, type: str, **fields) -> None:
        self.events.append(sse_event({"type": type, **fields}, type))

    def _start(self, block: dict) -> dict:
        self._close()
        self.blocks.append(block)
        self.open = block
        self._event("content_block_start", index=len(self.blocks) - 1, content_block=dict(block))
        return block

    def _append(self, kind: str, delta: str) -> None:
        block = self.open
        if block is None or block["type"] != kind:
            block = self._start(
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
        block[kind] += delta
        d = (
            {"type": "thinking_delta", "thinking": delta}
            if kind == "thinking"
            else {"type": "text_delta", "text": delta}
        )
        self._event("content_block_delta", index=len(self.blocks) - 1, delta=d)

    def _close(self) -> None:
        if self.open is not None:
            block, self.open = self.open, None
            if block["type"] == "tool_use":
                args = block.pop("_args")
                try:
                    block["input"] = json.loads(args) if args else {}
                except json.JSONDecodeError:
                    block["input"] = {}
            self._event("content_block_stop", index=len(self.blocks) - 1)

    def _tool_use(self, d: ToolDelta) -> None:
        """A piece of a call: its tool_use block starts with the call's first piece; input_json_delta after."""
        if d.id is not None:
            block = {"type": "tool_use", "id": "toolu_" + d.id.removeprefix("call_"), "name": d.name, "input": {}}
            self._start(block)
            block["_args"] = ""
            self.calls += 1
            return
        self.open["_args"] += d.arguments
        delta = {"type": "input_json_delta", "partial_json": d.arguments}
        self._event("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def _advance(self, c, delta: str, finished: bool) -> None:
        reasoning, pieces = self.text.feed(delta, finished)
        if reasoning:
            self._append("thinking", reasoning)
        for p in pieces:
            if p.index is None:
                self._append("text", p.content)
            else:
                self._tool_use(p)
        if not finished:
            return
        self._close()
        self.stop = _stop(c, self.calls)

    def _usage(self, gen) -> dict:
        prompt, completion, cached = gen.counts()
        return {
            "input_tokens": prompt - cached,
            "output_tokens": completion,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }

    def body(self, gen) -> dict:
        c = gen.finals[0].outputs[0]
        self._advance(c, c.text, True)
        return {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": gen.model,
            "content": self.blocks,
            "stop_reason": self.stop[0],
            "stop_sequence": self.stop[1],
            "usage": self._usage(gen),
        }

    def stream_open(self, gen) -> list[str]:
        prompt = gen.counts()[0]
        self._event(
            "message_start",
            message={
                "id": self.mid,
                "type": "message",
                "role": "assistant",
                "model": gen.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt, "output_tokens": 0},
            },
        )
        return self._take()

    def stream_output(self, gen, i: int, out) -> list[str]:
        c = out.outputs[0]
        self._advance(c, c.delta_text, out.finished)
        return self._take()

    def stream_close(self, gen) -> list[str]:
        self._event(
            "message_delta", delta={"stop_reason": self.stop[0], "stop_sequence": self.stop[1]}, usage=self._usage(gen)
        )
        self._event("message_stop")
        return self._take()

    def stream_error(self, gen, e: APIError) -> list[str]:
        return [sse_event(anthropic_error_body(e.status, e.message), "error")]

    def ping(self) -> str:
        return sse_event({"type": "ping"}, "ping")

    def _take(self) -> list[str]:
        events, self.events = self.events, []
        return events


# -- the routes (errors in Anthropic's shape on these paths: llmserve/errors.py) ---------------------------------
def _chat(body: _MessagesFields, state):
    try:
        single = (body.tool_choice or {}).get("disable_parallel_tool_use") is True
        return chat_messages(body), state.plan_tools(*chat_tools(body.tools, body.tool_choice), not single)
    except ValueError as e:
        raise from_value_error(e) from e


@router.post(
    "/v1/messages",
    response_model=MessageObject,
    responses=ANTHROPIC_ERROR_RESPONSES,
    summary="Anthropic's Messages API",
)
async def messages(body: MessagesRequest, request: Request, state: State):
    eng = state.engine_or_503()
    model = state.check_model(body.model)
    msgs, tool_plan = _chat(body, state)
    runs = await chat_runs(
        eng, state.settings, body, msgs, body.max_tokens, tool_plan, template_kwargs=body.template_kwargs()
    )
    rendering = MessagesRendering(body, tool_plan, state.reasoning)
    gen = Generation(state, eng, rendering.mid, runs, body.priority, model, request, rendering)
    return await gen.response(body.stream)


@router.post(
    "/v1/messages/count_tokens",
    response_model=CountTokensResponse,
    responses=ANTHROPIC_ERROR_RESPONSES,
    summary="Anthropic's token count of a Messages request",
)
async def count_tokens(body: CountTokensRequest, state: State):
    eng = state.engine_or_503()
    state.check_model(body.model)
    msgs, tool_plan = _chat(body, state)
    images = await chat_images(eng, state.settings, msgs)  # (image tokens count)
    ids = await asyncio.to_thread(encode_chat, eng.tokenizer, msgs, True, body.template_kwargs(), tool_plan, images)
    return CountTokensResponse(input_tokens=len(ids))
