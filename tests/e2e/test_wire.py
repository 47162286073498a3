"""What goes over the wire, checked the way clients we did not write read it.

- `vllm bench serve` strips whitespace from every network read before it splits SSE events: a comment
  line (`: ping`) read on its own then glues onto the next event and the whole stream is dropped.
  Neither vLLM nor OpenAI sends comments, so llmserve sends none unless `--sse-ping-interval` asks.
- urllib and requests write the whole body before they read the answer: a server that answers 413 and
  closes while the body is still arriving resets the connection, and the client never sees the 413.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import httpx
import pytest

from llmserve.testing.launcher import ServerProcess

LIMIT = 100_000
PROMPT = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}


def _stripping_reader(reads: list[bytes]) -> tuple[int, str]:
    """(chunks with choices, text) as `vllm bench serve` (0.32) reads a stream: each network read is
    stripped of surrounding whitespace, appended to a buffer that is split on blank lines; messages that
    start with ':' are skipped, and a buffer that is one whole `data:` JSON counts as a message."""
    buffer, chunks, text = "", 0, ""
    for raw in reads:
        raw = raw.strip()
        if not raw:
            continue
        buffer += raw.decode()
        messages = []
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            if message.strip():
                messages.append(message.strip())
        if buffer.startswith("data: "):
            body = buffer.removeprefix("data: ").strip()
            try:
                if body == "[DONE]" or json.loads(body) is not None:
                    messages.append(buffer.strip())
                    buffer = ""
            except json.JSONDecodeError:
                pass
        for m in messages:
            if m.startswith(":"):
                continue
            data = m.removeprefix("data: ")
            if data != "[DONE]":
                choices = json.loads(data).get("choices")
                if choices:
                    chunks += 1
                    text += choices[0].get("text") or ""
    return chunks, text


async def _streams(url: str, n: int) -> list[list[bytes]]:
    """n concurrent streamed completions; each one's network reads as they came."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def one() -> list[bytes]:
            async with client.stream("POST", url + "/v1/completions", json=PROMPT) as r:
                assert r.status_code == 200
                return [chunk async for chunk in r.aiter_raw()]

        return await asyncio.gather(*(one() for _ in range(n)))


def _server(*flags: str) -> ServerProcess:
    srv = ServerProcess("--max-num-seqs", "1", "--max-request-body-bytes", str(LIMIT), *flags)
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def server():
    srv = _server()
    try:
        yield srv
    finally:
        srv.kill()


def test_streams_carry_no_comments_by_default(server):
    """One running request at a time: the others wait for their first token, as under load."""
    for reads in asyncio.run(_streams(server.url, 4)):
        body = b"".join(reads)
        assert not body.startswith(b":") and b"\n:" not in body
        chunks, text = _stripping_reader(reads)
        assert chunks >= 2 and text


def test_pings_are_opt_in_and_are_what_such_clients_lose():
    srv = _server("--sse-ping-interval", "0.05")
    try:
        all_reads = asyncio.run(_streams(srv.url, 4))
    finally:
        srv.kill()
    pinged = [reads for reads in all_reads if b": ping\n\n" in b"".join(reads)]
    assert pinged, "streams that waited for their first token carry pings when asked for"
    # the stripping client loses the streams whose pings came alone (the failure the default avoids)
    assert any(_stripping_reader(reads)[0] == 0 for reads in pinged)


def _raw_post(url: str, head: str, body_parts: list[bytes]) -> bytes:
    """Write the request headers and the whole body before reading anything, as urllib does."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head.encode())
        for part in body_parts:
            s.sendall(part)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        return answer


def test_oversize_body_written_whole_first_gets_the_413(server):
    big = json.dumps({"prompt": "x" * (10 * 1024 * 1024), "max_tokens": 1}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=big, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413
    assert json.loads(e.value.read())["error"]["code"] == "request_too_large"

    # the same through a raw socket, body declared and body chunked (its size unknown until it is read)
    answer = _raw_post(
        server.url,
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(big)}\r\n\r\n",
        [big],
    )
    assert answer.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in answer
    mib = b"x" * (1024 * 1024)
    chunks = [b"%x\r\n%s\r\n" % (len(mib), mib)] * 3 + [b"0\r\n\r\n"]
    answer = _raw_post(
        server.url,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        "\r\nTransfer-Encoding: chunked\r\n\r\n",
        chunks,
    )
    assert answer.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in answer
    # and the server still serves
    r = httpx.post(server.url + "/v1/completions", json={**PROMPT, "stream": False}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_chat_stream_opens_with_its_first_token(server):
    """vLLM sends the assistant-role chunk with the first token, and `vllm bench serve` times the first
    token from the first chunk: a role chunk sent as the request is queued would fake the TTFT. With one
    running request at a time, the second stream's first chunk comes after the first stream's last."""
    chat = {
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(delay: float) -> list[tuple[float, dict]]:
                await asyncio.sleep(delay)
                got = []
                async with client.stream("POST", server.url + "/v1/chat/completions", json=chat) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            got.append((time.monotonic(), json.loads(line[6:])))
                return got

            return await asyncio.gather(one(0), one(0.2))

    first, second = asyncio.run(main())
    assert first[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert second[0][0] >= first[-1][0]


def test_continuous_usage_stats(server):
    body = {**PROMPT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 24 and counts[0] < 24
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] > 0 for c in chunks)
