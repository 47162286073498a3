"""How an engine output becomes an API's answer: the one thing the APIs differ in.

serving.Generation runs the request (the engine stream, pings, timeout, abort, usage counts); a
rendering turns the outputs into the API's JSON body or its SSE events:
- `body(gen)`: the whole answer once every choice is done;
- `stream_open(gen)`, `stream_output(gen, i, out)`, `stream_close(gen)`, `stream_error(gen, e)`: the
  stream's events (SSE text) before the first output, for each output, after the last one, and on failure.

ChoicesRendering is OpenAI's chat / text completion envelope (`choices[]`, chunks, the usage chunk,
`[DONE]`); ChatRendering and CompletionRendering say how one choice looks in it:
- `choice(i, out)`: the finished choice of a JSON answer;
- `opening(i)`: a choice's first chunks, sent with its first output (chat: the assistant role;
  completions with echo: the prompt);
- `deltas(i, out)`: the stream's chunks for one output (none when it carries nothing to send).
The Responses and Messages APIs have their own renderings (openai_responses.py, anthropic_messages.py).
ChoiceText splits a choice's text into reasoning (--reasoning-parser), content and tool calls for all of
them. Logprobs are formatted here too, in each API's shape.
"""

from __future__ import annotations

import json

from llmserve.engine.request import RequestOutput
from llmserve.server import tools as tools_mod
from llmserve.server.errors import APIError
from llmserve.server.reasoning import ReasoningParser


def sse_event(data: dict, event: str | None = None) -> str:
    """One server-sent event: `event: NAME` (the Responses and Messages APIs name theirs) and its JSON data."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


class ChoiceText:
    """One choice's text as it arrives, split into reasoning (with a reasoning parser) and content; with tools
    to parse (a tools.ToolPlan whose `parse` is true) the content is held back and parsed into calls at the end.
    `feed(delta, finished)` returns the (reasoning, content) to send now."""

    def __init__(self, reasoning: ReasoningParser | None, tool_plan: tools_mod.ToolPlan | None = None) -> None:
        self.split = reasoning.stream() if reasoning is not None else None
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.parse else None
        self.reasoning, self.content = "", ""

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        r, c = self.split.feed(delta) if self.split is not None else ("", delta)
        if finished and self.split is not None:
            r2, c2 = self.split.flush()
            r, c = r + r2, c + c2
        self.reasoning += r
        self.content += c
        return r, ("" if self.tool_plan is not None else c)

    def calls(self) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of the finished content; no calls without tools to parse."""
        if self.tool_plan is None:
            return self.content, []
        return tools_mod.parse(self.content, self.tool_plan)

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


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tok, lps) -> dict | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        t = _token_text(tok, lp.token_id)
        content.append(
            {
                "token": t,
                "logprob": lp.logprob,
                "bytes": list(t.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (x := _token_text(tok, a.token_id)),
                        "logprob": a.logprob,
                        "bytes": list(x.encode("utf-8")),
                    }
                    for a in lp.top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(tok, lps, offset: int = 0) -> dict | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        t = _token_text(tok, lp.token_id)
        offsets.append(offset)
        offset += len(t)
        tokens.append(t)
        token_lps.append(lp.logprob)
        tops.append({_token_text(tok, a.token_id): a.logprob for a in lp.top} if lp.top else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


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

    def opening(self, i: int) -> list[dict]:
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
            choices = self.opening(i) + choices
        opts = gen.stream_options
        usage = gen.usage() if opts is not None and opts.include_usage and opts.continuous_usage_stats else None
        return [self._chunk(gen, [c], usage) for c in choices]

    def stream_close(self, gen) -> list[str]:
        usage = [self._chunk(gen, [], gen.usage())] if gen.stream_options and gen.stream_options.include_usage else []
        return usage + ["data: [DONE]\n\n"]

    def stream_error(self, gen, e: APIError) -> list[str]:
        return [e.sse(), "data: [DONE]\n\n"]


class ChatRendering(ChoicesRendering):
    """/v1/chat/completions. With a reasoning parser, the reasoning goes in `reasoning_content`; with tools to
    parse, a choice's content is held back while it streams and parsed into `tool_calls` when it finishes."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, tokenizer, tool_plan: tools_mod.ToolPlan | None = None, reasoning: ReasoningParser | None = None
    ) -> None:
        super().__init__()
        self.tok = tokenizer
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.parse else None
        self.reasoning = reasoning
        self.texts: dict[int, ChoiceText] = {}

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        text = ChoiceText.whole(c.text, self.reasoning, self.tool_plan)
        content, calls = text.calls()
        message, finish = {"role": "assistant", "content": content}, c.finish_reason
        if self.reasoning is not None:
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

    def opening(self, i: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]

    def deltas(self, i: int, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        text = self.texts.setdefault(i, ChoiceText(self.reasoning, self.tool_plan))
        reasoning, content = text.feed(c.delta_text, out.finished)
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if self.tool_plan is None:
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
        chunks = [_delta(i, delta)] if delta else []  # reasoning streams; the content waits for the parse
        return chunks + (self._tool_deltas(i, c, text) if out.finished else [])

    @staticmethod
    def _tool_deltas(i: int, c, text: ChoiceText) -> list[dict]:
        content, calls = text.calls()
        out = [_delta(i, {"content": content})] if content else []
        out += [_delta(i, {"tool_calls": [d]}) for d in tools_mod.stream_deltas(calls)]
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        return out + [{**_delta(i, {}), "finish_reason": finish, "stop_reason": c.stop_reason}]


def _delta(i: int, delta: dict) -> dict:
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}


class CompletionRendering(ChoicesRendering):
    """/v1/completions; with `echo`, each choice's text starts with its prompt. `runs` are the
    generation's (choice index, prompt index, prompt token ids, SamplingParams)."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer, runs, echo: bool = False) -> None:
        super().__init__()
        self.tok, self.runs, self.echo = tokenizer, runs, echo

    def _prompt_text(self, index: int) -> str:
        ids = next(r[2] for r in self.runs if r[0] == index)
        return self.tok.decode(ids, skip_special_tokens=False)

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        prefix = self._prompt_text(i) if self.echo else ""
        return {
            "index": i,
            "text": prefix + c.text,
            "logprobs": completion_logprobs(self.tok, c.logprobs, len(prefix)),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def opening(self, i: int) -> list[dict]:
        if not self.echo:
            return []
        return [{"index": i, "text": self._prompt_text(i), "logprobs": None, "finish_reason": None}]

    def deltas(self, i: int, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        if not c.delta_text and not out.finished:
            return []
        choice = {
            "index": i,
            "text": c.delta_text,
            "logprobs": completion_logprobs(self.tok, c.delta_logprobs),
            "finish_reason": c.finish_reason,
        }
        if out.finished:
            choice["stop_reason"] = c.stop_reason
        return [choice]
