"""How an engine output becomes an API's answer: the one thing the APIs differ in.

serving.Generation runs the request (the engine stream, pings, timeout, abort, usage counts); a
rendering turns the outputs into the API's JSON body or its SSE events:
- `body(gen)`: the whole answer once every choice is done;
- `stream_open(gen)`, `stream_output(gen, i, out)`, `stream_close(gen)`, `stream_error(gen, e)`: the
  stream's events (SSE text) before the first output, for each output, after the last one, and on failure.

ChoicesRendering is OpenAI's chat / text completion envelope (`choices[]`, chunks, the usage chunk,
`[DONE]`); api/chat.py's ChatRendering and api/completions.py's CompletionRendering say how one choice
looks in it:
- `choice(i, out)`: the finished choice of a JSON answer;
- `opening(i, out)`: a choice's first chunks, sent with its first output (chat: the assistant role;
  completions with echo: the prompt and its logprobs);
- `deltas(i, out)`: the stream's chunks for one output (none when it carries nothing to send).
The Responses, Messages and embeddings APIs have their own renderings (api/responses.py, api/messages.py,
api/embeddings.py). ChoiceText splits a choice's text into reasoning (--reasoning-parser), content and tool
calls for all of them.
"""

from __future__ import annotations

import json

from llmserve.engine.request import RequestOutput
from llmserve.server import tool_parsers
from llmserve.server.errors import APIError
from llmserve.server.reasoning import ReasoningParser
from llmserve.server.tool_parsers import ToolDelta


def sse_event(data: dict, event: str | None = None) -> str:
    """One server-sent event: `event: NAME` (the Responses and Messages APIs name theirs) and its JSON data."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


class ChoiceText:
    """One choice's text as it arrives, split into reasoning (with a reasoning parser), content and, with tools
    to parse (a tool_parsers.ToolPlan whose `parse` is true), tool calls as the model writes them.
    `feed(delta, finished)` returns the reasoning to send now and the answer's pieces in order
    (tool_parsers.ToolDelta: content text, or a call's id and name, or its next arguments)."""

    def __init__(self, reasoning: ReasoningParser | None, tool_plan: tool_parsers.ToolPlan | None = None) -> None:
        self.split = reasoning.stream() if reasoning is not None else None
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.parse else None
        self.tools = self.tool_plan.stream() if self.tool_plan is not None else None
        self.reasoning, self.content = "", ""
        self.pieces: list[ToolDelta] = []  # with tools: every piece so far

    def feed(self, delta: str, finished: bool = False) -> tuple[str, list[ToolDelta]]:
        r, c = self.split.feed(delta) if self.split is not None else ("", delta)
        if finished and self.split is not None:
            r2, c2 = self.split.flush()
            r, c = r + r2, c + c2
        self.reasoning += r
        if self.tools is None:
            self.content += c
            return r, [ToolDelta(content=c)] if c else []
        pieces = self.tools.feed(c, finished)
        r2 = "".join(d.reasoning for d in pieces)  # a format with its own reasoning channel (openai)
        if r2:
            self.reasoning += r2
            r, pieces = r + r2, [d for d in pieces if not d.reasoning]
        self.pieces += pieces
        self.content += "".join(d.content for d in pieces)
        return r, pieces

    def calls(self) -> tuple[str | None, list[dict]]:
        """(content, tool calls in OpenAI's shape) so far; no calls without tools to parse."""
        if self.tools is None:
            return self.content, []
        return tool_parsers.collect(self.pieces)

    @classmethod
    def whole(cls, text: str, reasoning: ReasoningParser | None, tool_plan=None) -> "ChoiceText":
        t = cls(reasoning, tool_plan)
        t.feed(text, finished=True)
        return t


class Rendering:
    """The interface serving.Generation drives; see the module's docstring."""

    def body(self, gen) -> dict:
        raise NotImplementedError

    def stream_open(self, gen) -> list[str]:
        return []

    def stream_output(self, gen, i: int, out: RequestOutput) -> list[str]:
        raise NotImplementedError

    def stream_close(self, gen) -> list[str]:
        return []

    def stream_error(self, gen, e: APIError) -> list[str]:
        return [e.sse()]

    def ping(self) -> str:
        return ": ping\n\n"

    def completion_tokens(self, out: RequestOutput) -> int:
        """The tokens `out` counts as its completion in usage (what the answer shows)."""
        return len(out.outputs[0].token_ids)


def token_text(tok, token_id: int) -> str:
    """One token's text, special tokens included (logprobs name their tokens so)."""
    return tok.decode([token_id], skip_special_tokens=False)


def vllm_prompt_logprobs(tok, plps, top: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for the token and
    the `top` best at its position (the first token: None), from the engine's prompt logprobs."""
    if plps is None:
        return None
    out: list = []
    for lp in plps:
        if lp is None:
            out.append(None)
            continue
        entries = {lp.token_id: (lp.logprob, lp.rank)}
        for a in lp.top[:top]:
            entries.setdefault(a.token_id, (a.logprob, a.rank))
        out.append({t: {"logprob": v, "rank": r, "decoded_token": token_text(tok, t)} for t, (v, r) in entries.items()})
    return out


class ChoicesRendering(Rendering):
    """OpenAI's chat and text completion envelope: `choices[]` in one JSON body, or a chunk per choice delta,
    the usage chunk when stream_options ask for it (usage so far on every chunk with continuous_usage_stats,
    vLLM's), an error event on failure, then `[DONE]`. A choice's opening chunks go out with its first
    output, as vLLM sends them: clients time the first token from the first chunk."""

    object = chunk_object = ""

    def __init__(self) -> None:
        self.opened: set[int] = set()

    def choice(self, i: int, out: RequestOutput) -> dict:
        raise NotImplementedError

    def opening(self, i: int, out: RequestOutput) -> list[dict]:
        return []

    def deltas(self, i: int, out: RequestOutput) -> list[dict]:
        raise NotImplementedError

    def body(self, gen) -> dict:
        choices = [self.choice(i, gen.finals[i]) for i in sorted(gen.finals)]
        return {
            "id": gen.rid,
            "object": self.object,
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
            "usage": gen.usage(),
        }

    def _chunk(self, gen, choices: list, usage=None) -> str:
        d = {"id": gen.rid, "object": self.chunk_object, "created": gen.created, "model": gen.model, "choices": choices}
        if usage is not None:
            d["usage"] = usage
        return sse_event(d)

    def stream_output(self, gen, i: int, out: RequestOutput) -> list[str]:
        choices = self.deltas(i, out)
        if i not in self.opened:
            self.opened.add(i)
            choices = self.opening(i, out) + choices
        opts = gen.stream_options
        usage = gen.usage() if opts is not None and opts.include_usage and opts.continuous_usage_stats else None
        return [self._chunk(gen, [c], usage) for c in choices]

    def stream_close(self, gen) -> list[str]:
        usage = [self._chunk(gen, [], gen.usage())] if gen.stream_options and gen.stream_options.include_usage else []
        return usage + ["data: [DONE]\n\n"]

    def stream_error(self, gen, e: APIError) -> list[str]:
        return [e.sse(), "data: [DONE]\n\n"]
