"""`openai`: gpt-oss, whose answers are harmony messages, one per channel (special tokens: these answers are
decoded with skip_special_tokens off; the call's line is wrapped here):

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

`analysis` is reasoning; a message to `functions.NAME` (the recipient before or after the channel) is a
call whose body is its arguments; `final` and other `commentary` are content."""

from __future__ import annotations

import json
import re

import llmserve.server.tool_parsers.structure as S
from llmserve.server.tool_parsers.base import Memo, Partial, Scan, ToolParser, held

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = "to=functions."
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


class OpenAIParser(ToolParser):
    name = "openai"
    starts = (START, CHANNEL)
    keep_special_tokens = True
    always = True
    instructions = (
        "To call a function, write a message to it on the commentary channel, its arguments a JSON object:\n"
        "<|channel|>commentary to=functions.<function-name> <|constrain|>json<|message|><arguments-json-object><|call|>"
    )

    def format_call(self, name: str, args) -> str:
        body = json.dumps(args, ensure_ascii=False)
        return f"{CHANNEL}commentary {RECIPIENT}{name} <|constrain|>json{MESSAGE}{body}<|call|>"

    def strict_format(self, calls: list[tuple[str, dict]]) -> dict:
        """From the recipient on: the rest of the header (the channel when the recipient came first, the
        constraint), the message, its arguments, `<|call|>`."""
        rest = S.regex(r"( ?<\|channel\|>commentary)?( ?<\|constrain\|>)?( ?json)?<\|message\|>")
        tags = [S.tag(RECIPIENT + n, S.seq(rest, S.schema(s)), "<|call|>") for n, s in calls]
        return S.triggered([RECIPIENT], tags)

    def region(self, buf: str, marker: str, final: bool, memo: Memo) -> Scan:
        at = memo.find(buf, MESSAGE)
        if at < 0:
            # a header is short; one that runs on, or into another message, is not harmony
            bad = len(buf) > 300 or any(e in buf for e in ENDS) or (final and bool(buf.strip()))
            return Scan(end=len(buf), ok=False) if bad or final else Scan()
        header = marker + buf[:at]
        start = at + len(MESSAGE)
        hits = [(memo.find(buf, e, start), e) for e in (*ENDS, START)]
        hits = [(k, e) for k, e in hits if k >= 0]
        if hits:
            stop, e = min(hits)
            body, end = buf[start:stop], stop + (len(e) if e != START else 0)
        else:
            body = buf[start:]
            body, end = (body, len(buf)) if final else (body[: len(body) - held(body, (*ENDS, START))], None)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            p = Partial(name=recipient.group(1), args=body, complete=end is not None)
            scan = Scan(calls=[p], end=end)
            if end is not None:
                try:
                    scan.ok = isinstance(json.loads(body), dict) and self.known(p.name)
                except json.JSONDecodeError:
                    scan.ok = False
            return scan
        channel = _CHANNEL.search(header)
        if channel is not None and channel.group(1) == "analysis":
            return Scan(end=end, reasoning=body)
        return Scan(end=end, text=body)
