"""`llmserve bench`'s client against a server that closes a kept-alive connection when the next request arrives on
it, without a byte of answer (llama-server does so after each streamed answer: every other request of a serial run
failed with "Server disconnected without sending a response"). Nothing ran, so the client sends it again once on a
new connection; a connection dropped after an answer began still counts as an incomplete stream."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from llmserve.bench.client import BenchRequest, OpenAIClient

pytestmark = pytest.mark.timeout(60)


def _answer(n: int) -> bytes:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": " tok"}}]}
    last = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": n}}
    events = [chunk] * n + [last, usage]
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


async def _serve(drop: str):
    """A loopback HTTP/1.1 server: every connection's first request answered in full (keep-alive), its second one
    read and then dropped: `drop` "before" (no byte of answer) or "midway" (headers and half the stream)."""
    seen = {"connections": 0, "requests": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            for n in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(re.search(rb"(?i)content-length: *(\d+)", head).group(1)))
                seen["requests"] += 1
                body = _answer(4)
                status = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
                if n == 1 and drop == "before":
                    break
                if n == 1:
                    writer.write(status + body[: len(body) // 2])
                    await writer.drain()
                    break
                writer.write(status + body)
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


async def _two_requests(drop: str):
    server, url, seen = await _serve(drop)
    client = OpenAIClient(url, model="m")
    try:
        recs = [await client.send(BenchRequest("Hello there", 2, 4)) for _ in range(2)]
    finally:
        await client.aclose()
        server.close()
    return recs, seen


def test_request_sent_again_where_a_kept_alive_connection_was_closed_unanswered():
    recs, seen = asyncio.run(_two_requests("before"))
    assert [r.success for r in recs] == [True, True], [r.error_detail for r in recs]
    assert recs[1].output_tokens == 4 and recs[1].ttft is not None
    assert seen == {"connections": 2, "requests": 3}  # the second request: dropped once, answered on a new connection


def test_connection_dropped_after_an_answer_began_is_not_sent_again():
    recs, seen = asyncio.run(_two_requests("midway"))
    assert recs[0].success and not recs[1].success and recs[1].error == "incomplete_stream"
    assert seen == {"connections": 1, "requests": 2}
