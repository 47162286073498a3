"""OpenAI's Responses API: POST /v1/responses, stateless, over the chat machinery.

A request becomes a chat: `instructions` the system message, `input` (a string, or items: messages with
text parts, `function_call` items and their `function_call_output`s) the turns, function `tools` and
`tool_choice` the chat API's (tool_parsers/: rendered into the prompt, forced by the grammar, parsed from
the output as it is written), `text.format` a response_format (guided decoding), `max_output_tokens`
max_tokens. vLLM's sampling and guided_* extras are accepted as well. Nothing is stored: `store` is
answered false, and a `previous_response_id` (or a `conversation`) is refused with a 400 that says to send
the whole input.

The answer is a `response` object whose `output` holds a `reasoning` item (with --reasoning-parser), a
`message` item with one `output_text` part, and `function_call` items. Streamed, it is the official event
sequence: response.created, response.in_progress; per item output_item.added, content_part.added, its text
deltas (response.output_text.delta or response.reasoning_text.delta), their .done, content_part.done,
output_item.done (a function call: output_item.added with its name, function_call_arguments.delta as the
arguments are written, .done, output_item.done); then response.completed (or response.incomplete when
max_output_tokens cut it short). A failure mid-stream is an `error` event and
response.failed. Every event carries its `sequence_number`.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any, Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from llmserve.server import protocol as P
from llmserve.server.errors import APIError, from_value_error
from llmserve.server.prepare import chat_runs
from llmserve.server.reasoning import ReasoningParser
from llmserve.server.rendering import ChoiceText, Rendering, sse_event
from llmserve.server.serving import Generation
from llmserve.server.state import State
from llmserve.server.tool_parsers import ToolDelta

router = APIRouter()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request -------------------------------------------------------------------------------------------
class ResponsesRequest(P.EngineExtras):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Union[str, dict[str, Any], None] = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def response_format(self) -> dict | None:
        """`text.format` as the chat API's response_format (what tools.guided_kwargs reads)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise ValueError(
                'text.format: must be an object such as {"type": "json_schema", "name": ..., "schema": {...}}'
            )
        if fmt.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
        return {"type": fmt.get("type")}


def check_stateless(body: ResponsesRequest) -> None:
    """This server keeps no state: refuse what needs a stored response or conversation."""
    if body.previous_response_id is not None:
        raise APIError(
            400,
            f"previous_response_id: response {body.previous_response_id!r} was not stored: "
            f"this server stores no responses (store is always false); send the whole "
            f"conversation in input",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if body.conversation is not None:
        raise APIError(
            400,
            "conversation: this server stores no conversations; send the whole conversation in input",
            param="conversation",
            code="unsupported_parameter",
        )
    if body.background:
        raise APIError(
            400,
            "background: background responses need stored responses, which this server does not keep",
            param="background",
            code="unsupported_parameter",
        )


def _text(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """A message's or a tool output's text: a string, or text parts (input_text, output_text, text, refusal);
    with `images` (a message's content), input_image parts too: then chat parts (text and image_url)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of content parts")
    out: list[dict] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{k}].text: must be a string")
            out.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            out.append({"type": "text", "text": str(part.get("refusal") or "")})
        elif kind == "input_image" and images:
            if not isinstance(part.get("image_url"), str):
                raise ValueError(f"{where}[{k}].image_url: must be a URL (file_id needs stored files)")
            out.append({"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail")}})
        else:
            raise ValueError(f"{where}[{k}]: content parts of type {kind!r} are not supported (text and images)")
    if any(p["type"] == "image_url" for p in out):
        return out
    return "".join(p["text"] for p in out)


def chat_messages(body: ResponsesRequest) -> list[P.ChatMessage]:
    """`instructions` and `input` as chat messages; a bad item is a ValueError naming it (input[2].role: ...)."""
    msgs: list[dict] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for k, item in enumerate(items):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role: must be user, assistant, system or developer, got {role!r}")
            msgs.append({"role": role, "content": _text(item.get("content"), f"{where}.content", images=True)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
                raise ValueError(f"{where}: a function_call needs call_id, name and arguments (a JSON string)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # calls after the text of the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}.call_id: must be a string")
            msgs.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # earlier turns' reasoning is not shown to the model again (as chat templates drop it)
        elif kind == "item_reference":
            raise ValueError(f"{where}: item references need stored items; this server stores none")
        else:
            raise ValueError(
                f"{where}.type: {kind!r} items are not supported (message, function_call, "
                f"function_call_output, reasoning)"
            )
    if not msgs or all(m["role"] == "system" for m in msgs):
        raise ValueError("input: must hold at least one message")
    return [P.ChatMessage(**m) for m in msgs]


def chat_tools(tools: list[dict] | None, tool_choice: Any) -> tuple[list[dict] | None, Any]:
    """Function tools and tool_choice in the chat API's shape (tools.plan validates the rest)."""
    chat = None
    if tools:
        chat = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise ValueError(f"tools[{k}]: only function tools are supported, got type {kind!r}")
            f = {key: t[key] for key in ("name", "description", "parameters", "strict") if t.get(key) is not None}
            chat.append({"type": "function", "function": f})
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
            raise ValueError('tool_choice: must be "auto", "none", "required" or {"type": "function", "name": ...}')
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return chat, tool_choice


# -- the answer ------------------------------------------------------------------------------------------
class ResponsesRendering(Rendering):
    """The response object and its stream events (one choice). Output items are built as the text arrives,
    the same way for the JSON body (the whole text at once) and for the stream."""

    def __init__(
        self, tokenizer, body: ResponsesRequest, tool_plan=None, reasoning: ReasoningParser | None = None
    ) -> None:
        self.tok, self.req = tokenizer, body
        self.rid = _id("resp")
        self.text = ChoiceText(reasoning, tool_plan)
        self.items: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # function_call items by the call's index
        self.finish: str | None = None
        self.seq = 0
        self.events: list[str] = []

    # output items
    def _event(self, type: str, **fields) -> None:
        self.events.append(sse_event({"type": type, "sequence_number": self.seq, **fields}, type))
        self.seq += 1

    def _open(self, kind: str) -> dict:
        if self.open is not None and self.open["type"] == kind:
            return self.open
        self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self.open = item
        self._event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))
        item["content"].append(part)
        self._event(
            "response.content_part.added",
            item_id=item["id"],
            output_index=len(self.items) - 1,
            content_index=0,
            part=dict(part),
        )
        return item

    def _append(self, kind: str, delta: str) -> None:
        item = self._open(kind)
        item["content"][0]["text"] += delta
        where = {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}
        if kind == "reasoning":
            self._event("response.reasoning_text.delta", **where, delta=delta)
        else:
            self._event("response.output_text.delta", **where, delta=delta, logprobs=[])

    def _close(self, status: str = "completed") -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index = self.items.index(item)
        if item["type"] == "function_call":
            where = {"item_id": item["id"], "output_index": index}
            self._event(
                "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
            )
            item["status"] = status
            self._event("response.output_item.done", output_index=index, item=item)
            return
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            self._event("response.reasoning_text.done", **where, text=part["text"])
        else:
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
        self._event("response.content_part.done", **where, part=part)
        item["status"] = status
        self._event("response.output_item.done", output_index=where["output_index"], item=item)

    def _call(self, d: ToolDelta) -> None:
        """A piece of a function call: its item opens with the call's first piece; its arguments grow."""
        if d.id is not None:
            self._close()
            item = {"type": "function_call", "id": _id("fc"), "call_id": d.id, "name": d.name, "arguments": ""}
            item["status"] = "in_progress"
            self.items.append(item)
            self.open = self.calls[d.index] = item
            self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
            return
        item = self.calls[d.index]
        item["arguments"] += d.arguments
        index = self.items.index(item)
        self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=d.arguments)

    def _advance(self, delta: str, finished: bool, finish_reason: str | None) -> None:
        reasoning, pieces = self.text.feed(delta, finished)
        if reasoning:
            self._append("reasoning", reasoning)
        for p in pieces:
            if p.index is None:
                self._append("message", p.content)
            else:
                self._call(p)
        if not finished:
            return
        self.finish = finish_reason
        status = "incomplete" if finish_reason == "length" else "completed"
        if not self.items:  # nothing at all: one empty message, so that output_text is ""
            self._open("message")
        self._close(status)

    # the response object
    def _response(self, gen, status: str, usage: bool = True) -> dict:
        b = self.req
        fmt = (b.text or {}).get("format") or {"type": "text"}
        d = {
            "id": self.rid,
            "object": "response",
            "created_at": gen.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": gen.model,
            "output": copy.deepcopy(self.items),
            "parallel_tool_calls": b.parallel_tool_calls if b.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "reasoning": b.reasoning or {"effort": None, "summary": None},
            "store": False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt},
            "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": b.truncation or "disabled",
            "usage": self._usage(gen) if usage else None,
            "user": b.user,
            "metadata": b.metadata or {},
        }
        if status == "incomplete":
            d["incomplete_details"] = {"reason": "max_output_tokens"}
        return d

    def _usage(self, gen) -> dict:
        prompt, completion, cached = gen.counts()
        reasoning = len(self.tok.encode(self.text.reasoning, add_special_tokens=False)) if self.text.reasoning else 0
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, completion)},
            "total_tokens": prompt + completion,
        }

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def body(self, gen) -> dict:
        c = gen.finals[0].outputs[0]
        self._advance(c.text, True, c.finish_reason)
        return self._response(gen, self._status())

    def stream_open(self, gen) -> list[str]:
        self._event("response.created", response=self._response(gen, "in_progress", usage=False))
        self._event("response.in_progress", response=self._response(gen, "in_progress", usage=False))
        return self._take()

    def stream_output(self, gen, i: int, out) -> list[str]:
        c = out.outputs[0]
        self._advance(c.delta_text, out.finished, c.finish_reason)
        return self._take()

    def stream_close(self, gen) -> list[str]:
        status = self._status()
        self._event(f"response.{status}", response=self._response(gen, status))
        return self._take()

    def stream_error(self, gen, e: APIError) -> list[str]:
        self._event("error", code=e.code, message=e.message, param=e.param)
        failed = self._response(gen, "failed")
        failed["error"] = {"code": e.code or e.type, "message": e.message}
        self._event("response.failed", response=failed)
        return self._take()

    def _take(self) -> list[str]:
        events, self.events = self.events, []
        return events


class ResponseObject(BaseModel):
    """The documented shape of a non-streamed answer (for /openapi.json)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None


# -- the route -------------------------------------------------------------------------------------------
@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses=P.ERROR_RESPONSES,
    summary="OpenAI's Responses API (stateless)",
)
async def responses(body: ResponsesRequest, request: Request, state: State):
    eng = state.engine_or_503()
    model = state.check_model(body.model)
    check_stateless(body)
    try:
        messages = chat_messages(body)
        tool_plan = state.plan_tools(*chat_tools(body.tools, body.tool_choice), body.parallel_tool_calls)
    except ValueError as e:
        raise from_value_error(e) from e
    runs = await chat_runs(
        eng,
        state.settings,
        body,
        messages,
        body.max_output_tokens,
        tool_plan,
        template_kwargs=body.chat_template_kwargs,
        prompt_param="input",
        max_tokens_param="max_output_tokens",
    )
    rendering = ResponsesRendering(eng.tokenizer, body, tool_plan, state.reasoning)
    gen = Generation(state, eng, rendering.rid, runs, body.priority, model, request, rendering)
    return await gen.response(body.stream)
