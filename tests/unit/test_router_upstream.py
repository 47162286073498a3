"""The proxy's HTTP/1.1 client against raw asyncio servers on 127.0.0.1 that misbehave on cue."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.router.upstream import ConnectFailed, ConnectionLost, UpstreamPool
from llmserve.testing.launcher import free_port

pytestmark = pytest.mark.timeout(30)


async def serve(handler):
    """Start a raw TCP server; handler(reader, writer, n) handles connection number n."""
    count = 0

    async def on_conn(reader, writer):
        nonlocal count
        count += 1
        try:
            await handler(reader, writer, count)
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", lambda: count


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


def test_content_length_chunked_keep_alive_and_headers():
    async def handler(reader, writer, n):
        while True:
            try:
                req = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if b"/chunked" in req:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for part in (b"data: 1\n\n", b"data: 2\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                writer.write(b"0\r\n\r\n")
            else:
                body = req.split(b"\r\n\r\n", 1)[1]
                writer.write(b"HTTP/1.1 201 Created\r\nx-echo: yes\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def main():
        server, url, conns = await serve(handler)
        pool = UpstreamPool()
        try:
            r = await pool.request("POST", url, "/echo", [("content-type", "application/json")], b'{"a": 1}')
            assert r.status_code == 201 and r.headers["x-echo"] == "yes"
            assert await r.aread() == b'{"a": 1}'
            r = await pool.request("POST", url, "/chunked", [], b"{}")
            assert r.headers["content-type"] == "text/event-stream"
            assert [c async for c in r] == [b"data: 1\n\n", b"data: 2\n\n"]
            r = await pool.request("GET", url, "/echo", [])
            assert await r.aread() == b""
            assert conns() == 1  # one kept-alive connection for all three
        finally:
            await pool.aclose()
            server.close()

    asyncio.run(main())


def test_refused_connection_is_connect_failed():
    async def main():
        pool = UpstreamPool(connect_timeout=2)
        with pytest.raises(ConnectFailed):
            await pool.request("POST", f"http://127.0.0.1:{free_port()}", "/", [], b"")

    asyncio.run(main())


def test_server_dying_before_and_during_the_response():
    async def handler(reader, writer, n):
        req = await read_request(reader)
        if b"/die-mid" in req:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
            await writer.drain()
        # /die-early: close without a byte

    async def main():
        server, url, _ = await serve(handler)
        pool = UpstreamPool()
        try:
            with pytest.raises(ConnectionLost):
                await pool.request("POST", url, "/die-early", [], b"")
            r = await pool.request("POST", url, "/die-mid", [], b"")
            assert await r.__anext__() == b"partial"
            with pytest.raises(ConnectionLost):
                await r.__anext__()
        finally:
            await pool.aclose()
            server.close()

    asyncio.run(main())


def test_stale_kept_alive_connection_is_replaced_transparently():
    async def handler(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        # then close, as a server's keep-alive timeout would: the pooled connection is stale

    async def main():
        server, url, conns = await serve(handler)
        pool = UpstreamPool()
        try:
            for _ in range(3):
                r = await pool.request("GET", url, "/", [])
                assert await r.aread() == b"ok"
                await asyncio.sleep(0.05)
            assert conns() == 3
        finally:
            await pool.aclose()
            server.close()

    asyncio.run(main())


def test_aclose_of_an_unfinished_response_closes_the_connection():
    async def main():
        seen_eof = asyncio.Event()

        async def handler(reader, writer, n):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            if await reader.read(1) == b"":  # the client hung up
                seen_eof.set()

        server, url, _ = await serve(handler)
        pool = UpstreamPool()
        try:
            r = await pool.request("POST", url, "/", [], b"")
            assert await r.__anext__() == b"hello"
            await r.aclose()
            await asyncio.wait_for(seen_eof.wait(), 5)
        finally:
            await pool.aclose()
            server.close()

    asyncio.run(main())


def test_read_until_close_body():
    async def handler(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async def main():
        server, url, _ = await serve(handler)
        pool = UpstreamPool()
        try:
            r = await pool.request("GET", url, "/", [])
            assert await r.aread() == b"all of it"
        finally:
            await pool.aclose()
            server.close()

    asyncio.run(main())


def test_slow_consumer_pauses_reading_and_gets_everything():
    parts = [b"x" * 1000] * 300

    async def handler(reader, writer, n):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % sum(map(len, parts)))
        for p in parts:
            writer.write(p)
            await writer.drain()

    async def main():
        server, url, _ = await serve(handler)
        pool = UpstreamPool()
        try:
            r = await pool.request("GET", url, "/", [])
            got = b""
            async for chunk in r:
                got += chunk
                await asyncio.sleep(0)  # a consumer slower than the socket
            assert got == b"".join(parts)
        finally:
            await pool.aclose()
            server.close()

    asyncio.run(main())
