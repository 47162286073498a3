"""Server-sent events: an incremental `text/event-stream` parser fed raw bytes, and iterators over a
body's events (sync and async). Used by the bench client, the tests and the benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Iterable, Iterator


@dataclass
class SSEEvent:
    data: str
    event: str | None = None

    @property
    def done(self) -> bool:
        """The OpenAI stream's end marker, `data: [DONE]`."""
        return self.data.strip() == "[DONE]"

    def json(self):
        return json.loads(self.data)


class SSEParser:
    """Incremental parser for a `text/event-stream` body, fed raw bytes as they arrive.

    Reads may split a line anywhere, even inside a multi-byte UTF-8 character: bytes are buffered
    and only whole lines are decoded (a newline byte never occurs inside a UTF-8 sequence). Lines
    end with LF, CRLF or CR; lines starting with ':' are comments (keep-alive pings) and are counted
    in `comments`; a blank line ends an event; several `data:` lines join with a newline.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event: str | None = None
        self.comments = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        events: list[SSEEvent] = []
        while True:
            cut = _line_end(self._buf)
            if cut is None:
                return events
            end, nxt = cut
            line = self._buf[:end].decode("utf-8", errors="replace")
            self._buf = self._buf[nxt:]
            ev = self._line(line)
            if ev is not None:
                events.append(ev)

    def close(self) -> list[SSEEvent]:
        """End of body: the last line and event count even without their terminators (lenient)."""
        events = []
        if self._buf:
            ev = self._line(self._buf.decode("utf-8", errors="replace").rstrip("\r"))
            self._buf = b""
            if ev is not None:
                events.append(ev)
        ev = self._line("")
        if ev is not None:
            events.append(ev)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            if not self._data:
                self._event = None
                return None
            ev = SSEEvent("\n".join(self._data), self._event)
            self._data, self._event = [], None
            return ev
        if line.startswith(":"):
            self.comments += 1
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None  # id: and retry: do not matter here


def iter_sse(chunks: Iterable[bytes]) -> Iterator[SSEEvent]:
    """The events of a `text/event-stream` body given as byte chunks (e.g. httpx's `iter_bytes()`),
    each as soon as it is complete."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.close()


async def aiter_sse(chunks: AsyncIterable[bytes]) -> AsyncIterator[SSEEvent]:
    """`iter_sse` for an async byte stream (e.g. httpx's `aiter_bytes()`)."""
    parser = SSEParser()
    async for chunk in chunks:
        for ev in parser.feed(chunk):
            yield ev
    for ev in parser.close():
        yield ev


def _line_end(buf: bytes) -> tuple[int, int] | None:
    """(end of the first line, start of the next) or None while the first line is incomplete."""
    lf, cr = buf.find(b"\n"), buf.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return None if lf == -1 else (lf, lf + 1)
    if cr == len(buf) - 1:
        return None  # a CR at the end may be the first half of CRLF: wait for the next byte
    return (cr, cr + 2) if buf[cr + 1 : cr + 2] == b"\n" else (cr, cr + 1)
