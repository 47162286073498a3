"""OpenAI's chat completions API: POST /v1/chat/completions.

The messages are rendered with the chat template and tokenized (prepare.chat_runs; tool_parsers/ renders
`tools` into the prompt, forces `tool_choice` by the grammar and parses calls from the output), n choices
run as one Generation, and ChatRendering writes each choice in OpenAI's envelope (rendering.ChoicesRendering):
`message` / streamed `delta`s, `reasoning_content` with --reasoning-parser, `tool_calls`, logprobs.
"""

from __future__ import annotations

from typing import Any, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, model_validator

from llmserve.engine.request import RequestOutput
from llmserve.server import protocol as P
from llmserve.server import tool_parsers
from llmserve.server.errors import from_value_error
from llmserve.server.prepare import chat_runs
from llmserve.server.reasoning import ReasoningParser
from llmserve.server.rendering import ChoicesRendering, ChoiceText, token_text, vllm_prompt_logprobs
from llmserve.server.serving import Generation
from llmserve.server.state import State

router = APIRouter()


# -- protocol ------------------------------------------------------------------------------------------
class ChatCompletionRequest(P.SamplingFields):
    messages: list[P.ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # its most: --max-logprobs
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: P.UsageInfo


# -- the route -----------------------------------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=P.ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    eng = state.engine_or_503()
    model = state.check_model(body.model)
    try:
        tool_plan = state.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ValueError as e:
        raise from_value_error(e) from e
    runs = await chat_runs(
        eng,
        state.settings,
        body,
        body.messages,
        body.max_completion_tokens or body.max_tokens,
        tool_plan,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
    )
    gen = Generation(
        state,
        eng,
        P.random_id("chatcmpl"),
        runs,
        body.priority,
        model,
        request,
        ChatRendering(eng.tokenizer, tool_plan, state.reasoning, body.prompt_logprobs),
    )
    return await gen.response(body.stream, body.stream_options)


# -- rendering -----------------------------------------------------------------------------------------
def chat_logprobs(tok, lps) -> dict | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        t = token_text(tok, lp.token_id)
        content.append(
            {
                "token": t,
                "logprob": lp.logprob,
                "bytes": list(t.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (x := token_text(tok, a.token_id)),
                        "logprob": a.logprob,
                        "bytes": list(x.encode("utf-8")),
                    }
                    for a in lp.top
                ],
            }
        )
    return {"content": content}


class ChatRendering(ChoicesRendering):
    """/v1/chat/completions. With a reasoning parser, the reasoning goes in `reasoning_content`; with tools to
    parse, a choice's calls stream as the model writes them (`delta.tool_calls[]`: id, type and name once,
    then the arguments in pieces) and its message holds them as `tool_calls`.
    With vLLM's `prompt_logprobs`, the answer's `prompt_logprobs` (the templated prompt's, as vLLM's)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        tokenizer,
        tool_plan: tool_parsers.ToolPlan | None = None,
        reasoning: ReasoningParser | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        super().__init__()
        self.tok, self.prompt_logprobs = tokenizer, prompt_logprobs
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.parse else None
        self.reasoning = reasoning
        self.texts: dict[int, ChoiceText] = {}

    def body(self, gen) -> dict:
        body = super().body(gen)
        if self.prompt_logprobs is not None and gen.finals:
            first = gen.finals[min(gen.finals)]
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, first.prompt_logprobs, self.prompt_logprobs)
        return body

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        text = ChoiceText.whole(c.text, self.reasoning, self.tool_plan)
        content, calls = text.calls()
        message, finish = {"role": "assistant", "content": content}, c.finish_reason
        if self.reasoning is not None or text.reasoning:
            message["reasoning_content"] = text.reasoning or None
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        return {
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(self.tok, c.logprobs),
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
        }

    def opening(self, i: int, out: RequestOutput) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]

    def deltas(self, i: int, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        text = self.texts.setdefault(i, ChoiceText(self.reasoning, self.tool_plan))
        reasoning, pieces = text.feed(c.delta_text, out.finished)
        if self.tool_plan is None:
            delta = {"reasoning_content": reasoning} if reasoning else {}
            if pieces:
                delta["content"] = pieces[0].content
            if not delta and not out.finished:
                return []
            choice = {
                "index": i,
                "delta": delta,
                "logprobs": chat_logprobs(self.tok, c.delta_logprobs),
                "finish_reason": c.finish_reason,
            }
            if out.finished:
                choice["stop_reason"] = c.stop_reason
            return [choice]
        # with tools: the content as it comes, then each call's id and name once and its arguments as written
        chunks = [_delta(i, {"reasoning_content": reasoning})] if reasoning else []
        for p in pieces:
            d = {"content": p.content} if p.index is None else {"tool_calls": [tool_parsers.openai_delta(p)]}
            chunks.append(_delta(i, d))
        if out.finished:
            finish = "tool_calls" if text.calls()[1] and c.finish_reason == "stop" else c.finish_reason
            chunks.append({**_delta(i, {}), "finish_reason": finish, "stop_reason": c.stop_reason})
        return chunks


def _delta(i: int, delta: dict) -> dict:
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
