"""How an engine output becomes an OpenAI choice: the one thing chat and text completions differ in.

serving.Generation runs the request and builds the envelopes (JSON answer, SSE chunks, usage); a
rendering turns one choice's output into its `choices[]` entries:
- `choice(i, out)`: the finished choice of a JSON answer;
- `opening(i)`: a choice's first chunks, sent with its first output (chat: the assistant role;
  completions with echo: the prompt);
- `deltas(i, out)`: the stream's chunks for one output (none when it carries nothing to send).
Logprobs are formatted here too, in each API's shape.
"""
from __future__ import annotations

from llmserve.engine.request import RequestOutput
from llmserve.server import tools as tools_mod


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tok, lps) -> dict | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        t = _token_text(tok, lp.token_id)
        content.append({
            "token": t, "logprob": lp.logprob, "bytes": list(t.encode("utf-8")),
            "top_logprobs": [{"token": (x := _token_text(tok, a.token_id)), "logprob": a.logprob,
                              "bytes": list(x.encode("utf-8"))} for a in lp.top],
        })
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


class ChatRendering:
    """/v1/chat/completions. With tools to parse (a tools.ToolPlan whose `parse` is true), a choice's
    text is held back while it streams and parsed into `tool_calls` when it finishes."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer, tool_plan: tools_mod.ToolPlan | None = None) -> None:
        self.tok = tokenizer
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.parse else None

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
        if self.tool_plan is not None:
            content, calls = tools_mod.parse(c.text, self.tool_plan)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": i, "message": message, "logprobs": chat_logprobs(self.tok, c.logprobs),
                "finish_reason": finish, "stop_reason": c.stop_reason}

    def opening(self, i: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]

    def deltas(self, i: int, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        if self.tool_plan is not None:   # tool calls: the text is parsed when the choice finishes
            return self._tool_deltas(i, c) if out.finished else []
        if not c.delta_text and not out.finished:
            return []
        choice = {"index": i, "delta": {"content": c.delta_text} if c.delta_text else {},
                  "logprobs": chat_logprobs(self.tok, c.delta_logprobs), "finish_reason": c.finish_reason}
        if out.finished:
            choice["stop_reason"] = c.stop_reason
        return [choice]

    def _tool_deltas(self, i: int, c) -> list[dict]:
        content, calls = tools_mod.parse(c.text, self.tool_plan)
        out = []
        if content:
            out.append({"index": i, "delta": {"content": content}, "logprobs": None, "finish_reason": None})
        for d in tools_mod.stream_deltas(calls):
            out.append({"index": i, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None})
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish, "stop_reason": c.stop_reason})
        return out


class CompletionRendering:
    """/v1/completions; with `echo`, each choice's text starts with its prompt. `runs` are the
    generation's (choice index, prompt index, prompt token ids, SamplingParams)."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer, runs, echo: bool = False) -> None:
        self.tok, self.runs, self.echo = tokenizer, runs, echo

    def _prompt_text(self, index: int) -> str:
        ids = next(r[2] for r in self.runs if r[0] == index)
        return self.tok.decode(ids, skip_special_tokens=False)

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        prefix = self._prompt_text(i) if self.echo else ""
        return {"index": i, "text": prefix + c.text, "logprobs": completion_logprobs(self.tok, c.logprobs, len(prefix)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def opening(self, i: int) -> list[dict]:
        if not self.echo:
            return []
        return [{"index": i, "text": self._prompt_text(i), "logprobs": None, "finish_reason": None}]

    def deltas(self, i: int, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        if not c.delta_text and not out.finished:
            return []
        choice = {"index": i, "text": c.delta_text,
                  "logprobs": completion_logprobs(self.tok, c.delta_logprobs), "finish_reason": c.finish_reason}
        if out.finished:
            choice["stop_reason"] = c.stop_reason
        return [choice]
