"""The one interface of the tool-call parsers, and the streaming machine they share.

A parser (one module per model format) says where a call region starts (`starts`: markers anywhere in
the text; `leading`: a form that only opens the output, such as a bare JSON object) and how a region's
text reads (`region`: the calls so far, and where the region ends). ToolStream runs it over the text as
it arrives: content outside regions goes out at once (text that may still become a marker is held back),
and each call's id and name go out once its name is known, then its arguments as they are written.
`parse(text)` is the same machine fed the whole text at once, so a streamed answer and a whole one agree.

Streaming is incremental: a region's text only grows until the region ends, so the scanners keep what they
learned in the region's Memo and resume where they stopped (a call's arguments streamed in small pieces
are read once, not again with every piece: O(n) over the call, where a re-scan was O(n^2)).

A region that turns out malformed (bad JSON, a function that is not among the tools) before any of it
was sent stays content, with a log line; one that breaks after its first delta went out is logged.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("llmserve.server")

WAIT = -1  # leading(): not decided yet (the output so far may still open a call)


@dataclass
class ToolDelta:
    """One step of an answer: `content` text outside the calls, or a piece of call `index` (its first
    piece carries `id` and `name`; `arguments` are the arguments' JSON text as it grows)."""

    content: str = ""
    reasoning: str = ""  # a format whose reasoning is part of it (openai's analysis channel)
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Partial:
    """A call as far as its region's text goes: its name once known, its arguments' JSON text so far (None
    while they cannot be sent yet), whether the arguments are whole."""

    name: str | None = None
    args: str | None = None
    complete: bool = False


@dataclass
class Scan:
    """What a region's text holds: its calls, where it ends (None: not yet) and, once it ends, whether it
    was well-formed."""

    calls: list[Partial] = field(default_factory=list)
    end: int | None = None
    ok: bool = True
    text: str = ""  # content inside the region so far (formats whose answer text is in regions too)
    reasoning: str = ""


class Memo:
    """What the scanners learned about the open region's text, which only grows until the region ends: where
    to resume (keyed by what is scanned and where it starts), and the values read from parts that are whole.
    `work`: the characters the scanners read (over the stream: about the text's length, not its square)."""

    def __init__(self) -> None:
        self.work = 0
        self.state: dict = {}

    def clear(self) -> None:
        self.state.clear()

    def find(self, text: str, s: str, start: int = 0) -> int:
        """text.find(s, start), reading only what the last search from `start` did not."""
        key = ("find", s, start)
        frm = self.state.get(key, start)
        at = text.find(s, frm)
        self.work += (len(text) if at < 0 else at + len(s)) - frm
        self.state[key] = at if at >= 0 else max(start, len(text) - len(s) + 1)
        return at


class ToolParser:
    """A model format's tool calls. `tools`: the request's OpenAI tool objects (names and schemas)."""

    name = ""
    starts: tuple[str, ...] = ()  # markers that open a region anywhere in the text
    keep_special_tokens = False  # the markers are special tokens: decode with skip_special_tokens off
    always = False  # the whole output is in the format (harmony's channels): read it with tools or without
    # the default tools prompt's last part (a chat template that cannot render tools): how to call, in this format
    instructions = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.functions = {t["function"]["name"]: t["function"] for t in tools or []}

    def known(self, name: str | None) -> bool:
        return isinstance(name, str) and (not self.functions or name in self.functions)

    def leading(self, text: str) -> int | None:
        """At the output's start (`text` has no leading whitespace): the length of the marker that opens a
        region here (0: the region starts at once), None when the output does not open with one, WAIT."""
        return None

    def region(self, buf: str, marker: str, final: bool, memo: Memo) -> Scan:
        """The calls in `buf`, the text after `marker` (the one that opened the region). With `final` the
        output ended: the region ends too. `memo`: the region's (buf only grows between calls)."""
        raise NotImplementedError

    def strict_format(self, calls: list[tuple[str, dict]]) -> dict:
        """The xgrammar structural tag format (structure.py) of this format's calls under `strict: true`: the
        text free until a call opens, then one of `calls` (a function's name, its arguments' JSON schema)."""
        raise NotImplementedError

    def format_call(self, name: str, args) -> str:
        """One call as the model writes it (an assistant message's tool_calls, rendered without the chat
        template's help); `args` the arguments as an object (a string when they were not JSON). A format
        overrides this or, where the calls are written together (a list), format_calls."""
        return self.format_calls([(name, args)])

    def format_calls(self, calls: list[tuple[str, object]]) -> str:
        """A message's calls (name, arguments), as the model writes them."""
        return "\n".join(self.format_call(n, a) for n, a in calls)

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def stream(self, max_calls: int | None = None) -> ToolStream:
        return ToolStream(self, max_calls)

    def parse(self, text: str, max_calls: int | None = None) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished output, OpenAI's shape; content None when only calls."""
        return collect(self.stream(max_calls).feed(text, final=True))


def opens_with(text: str, first: str, tag: str) -> int | None:
    """ToolParser.leading for a region that opens with `first` (kept: it is part of the region) or `tag`."""
    if text.startswith(first):
        return 0
    if text.startswith(tag):
        return len(tag)
    return WAIT if tag.startswith(text) else None


def held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(text), len(m) - 1), best, -1):
            if m.startswith(text[-n:]):
                best = n
                break
    return best


class ToolStream:
    """One output's tool calls as its text arrives: feed(delta) and, at the end, flush() -> [ToolDelta].
    `max_calls`: calls past it are dropped (parallel_tool_calls false: 1)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.p, self.max_calls = parser, max_calls
        self.state = "start"  # start -> content <-> region
        self.buf, self.marker = "", ""
        self.count = 0  # calls begun so far (their indexes)
        self.region_calls: list[list] = []  # this region's calls: [index or None (dropped), id, args sent]
        self.blocked = False  # this region named an unknown function: nothing more goes out of it
        self.ws = ""  # whitespace after a region, held until text follows
        self.memo = Memo()  # the open region's scanning state (memo.work counts the whole stream's scanning)

    def feed(self, delta: str, final: bool = False) -> list[ToolDelta]:
        """The pieces `delta` completes; `final`: the output ends with it (what was held back goes out, an
        open region ends, and a region read whole is checked before any of it goes out)."""
        self.buf += delta
        out = self._run(final)
        if final and self.state == "content" and self.buf:
            out += self._content(self.buf)
            self.buf = ""
        return out

    def flush(self) -> list[ToolDelta]:
        return self.feed("", True)

    def _content(self, text: str) -> list[ToolDelta]:
        if not text:
            return []
        if self.count and not text.strip():  # whitespace between or after calls waits for text
            self.ws += text
            return []
        text, self.ws = self.ws + text, ""
        return [ToolDelta(content=text)]

    def _run(self, final: bool) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        while True:
            if self.state == "start":
                text = self.buf.lstrip()
                n = self.p.leading(text) if text else WAIT
                if n == WAIT and not final:
                    return out
                if n is None or n == WAIT:
                    self.state = "content"
                    continue
                self.marker, self.buf = text[:n], text[n:]
                self._open()
            elif self.state == "content":
                hits = [(self.buf.find(m), m) for m in self.p.starts]
                hits = [(at, m) for at, m in hits if at >= 0]
                if not hits:
                    keep = 0 if final else held(self.buf, self.p.starts)
                    out += self._content(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                at, m = min(hits)
                out += self._content(self.buf[:at])
                self.ws = ""
                self.marker, self.buf = m, self.buf[at + len(m) :]
                self._open()
            else:
                scan = self.p.region(self.buf, self.marker, final, self.memo)
                if scan.end is None and final:
                    scan.end = len(self.buf)
                out += self._calls(scan)
                if scan.end is None:
                    return out
                self.buf = self.buf[scan.end :]
                self.state = "content"

    def _open(self) -> None:
        self.state, self.region_calls, self.blocked = "region", [], False
        self.memo.clear()
        self.region_text = [0, 0]  # the region's text and reasoning sent so far (lengths)

    def _calls(self, scan: Scan) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        sent = any(c[0] is not None for c in self.region_calls) or any(self.region_text)
        if scan.end is not None and not scan.ok:
            raw = self.marker + self.buf[: scan.end]
            if not sent:
                log.warning("a malformed tool call is kept as content: %r", raw[:300])
                self.count -= len(self.region_calls)
                return self._content(raw)
            log.warning("a tool call broke off after it began streaming: %r", raw[:300])
        if len(scan.text) > self.region_text[0]:
            out += self._content(scan.text[self.region_text[0] :])
            self.region_text[0] = len(scan.text)
        if len(scan.reasoning) > self.region_text[1]:
            out.append(ToolDelta(reasoning=scan.reasoning[self.region_text[1] :]))
            self.region_text[1] = len(scan.reasoning)
        for k, p in enumerate(scan.calls):
            if self.blocked:
                break
            if k == len(self.region_calls):
                if p.name is None:
                    break
                if not self.p.known(p.name):
                    self.blocked = True  # held: the region ends as content (nothing of it went out)
                    break
                keep = self.max_calls is None or self.count < self.max_calls
                call = [self.count if keep else None, self.p.new_id(), ""]
                self.count += 1
                self.region_calls.append(call)
                if keep:
                    out.append(ToolDelta(index=call[0], id=call[1], name=p.name))
            call = self.region_calls[k]
            if call[0] is None or p.args is None or len(p.args) == len(call[2]):
                continue
            sent = len(call[2])  # what was sent must still be there: its last characters are checked
            if len(p.args) < sent or p.args[max(0, sent - 16) : sent] != call[2][-16:]:
                log.warning("tool call %d: its arguments changed after they were sent; kept as sent", call[0])
                continue
            out.append(ToolDelta(index=call[0], arguments=p.args[sent:]))
            call[2] = p.args
        return out


def new_mistral_id() -> str:
    """Mistral's tool call ids: 9 alphanumeric characters."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(9))


def collect(deltas: list[ToolDelta]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls in OpenAI's shape) of a whole answer's deltas; with calls, the content is
    stripped (None when empty)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.id is not None:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        calls[d.index]["function"]["arguments"] += d.arguments
    if not calls:
        return content, []
    return (content.strip() or None), [calls[i] for i in sorted(calls)]


def openai_delta(d: ToolDelta) -> dict:
    """A call delta in OpenAI's streamed shape (chat completions' `delta.tool_calls[]`)."""
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
    return {"index": d.index, "function": {"arguments": d.arguments}}
