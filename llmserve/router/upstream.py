"""A small HTTP/1.1 client for the proxy's hot path: keep-alive pools, streamed bodies.

Why not httpx here: at 20 concurrent streams the router spent about 5 ms of CPU per streamed
request, half of it inside httpx/httpcore/anyio (the pool scans every connection for each
request, each body chunk goes through several layers and a timeout scope). This client is one
asyncio Protocol per connection and the httptools parser (C, already installed with
uvicorn[standard]); a body chunk costs one callback and one queue put. httpx is still what the
router uses for health checks and metrics scraping, where speed does not matter.

What it does: `POST`/`GET` with a body already in memory; responses with Content-Length, chunked
or read-until-close bodies; keep-alive reuse; flow control (reading pauses while the consumer
lags); `aclose()` on an unfinished response closes the connection, which is how the backend
learns that the client went away. Errors: `ConnectFailed` (nothing reached the backend) and
`ConnectionLost` (it broke after connecting). A pooled connection that the server had already
closed is retried once on a fresh one, so an idle-timeout race never looks like a dead backend.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections import deque
from urllib.parse import urlsplit

import httptools

_EOF = object()
_HIGH_WATER, _LOW_WATER = 64, 16  # queued body chunks: pause / resume reading


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """Could not connect (refused, unreachable, timed out): the request never left."""


class ConnectionLost(UpstreamError):
    """The connection broke or the response was malformed."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; carries one request at a time."""

    def __init__(self, pool: "UpstreamPool", key: tuple):
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = 0  # requests sent on this connection
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future | None = None
        self.body: deque = deque()
        self.body_waiter: asyncio.Future | None = None
        self.got_bytes = False
        self.complete = False
        self.keep_alive = False
        self.paused = False
        self.delimited = False  # Content-Length or chunked: not read-until-close

    # -- asyncio.Protocol --
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionLost("unexpected protocol upgrade"))
        except httptools.HttpParserError as e:
            self._fail(ConnectionLost(f"malformed response: {e}"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.head is None or self.complete:
            return
        if self.head.done() and not self.delimited:  # read-until-close body: EOF ends it
            self.on_message_complete()
            return
        self._fail(ConnectionLost(f"connection closed by the backend ({exc or 'EOF'})"))

    def pause_writing(self) -> None:  # request bodies are small: nothing to do
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks --
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lname = name.lower()
        if lname == b"content-length" or (lname == b"transfer-encoding" and b"chunked" in value.lower()):
            self.delimited = True

    def on_headers_complete(self) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))
        self._wake()
        if len(self.body) > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        if self.head is not None and not self.head.done():
            self.head.set_result(self.parser.get_status_code())
        self.body.append(_EOF)
        self._wake()

    # -- helpers --
    def _wake(self) -> None:
        w = self.body_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        else:
            self.body.append(exc)
            self._wake()
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self.pool._forget(self)


class UpstreamResponse:
    def __init__(self, conn: _Connection, status: int):
        self._conn = conn
        self.status_code = status
        self.raw_headers = conn.headers
        self._done = False

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.raw_headers}

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        while True:
            if self._done:
                raise StopAsyncIteration
            if conn.body:
                item = conn.body.popleft()
                if conn.paused and len(conn.body) < _LOW_WATER and not conn.closed:
                    conn.paused = False
                    conn.transport.resume_reading()
                if item is _EOF:
                    self._finish()
                    raise StopAsyncIteration
                if isinstance(item, Exception):
                    self._done = True
                    raise item
                return item
            if conn.closed and not conn.complete:
                self._done = True
                raise ConnectionLost("connection closed by the backend")
            conn.body_waiter = asyncio.get_running_loop().create_future()
            try:
                await conn.body_waiter
            finally:
                conn.body_waiter = None

    async def aread(self) -> bytes:
        return b"".join([c async for c in self])

    def _finish(self) -> None:
        self._done = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed:
            self._conn.pool._release(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        """Done with the response: an unfinished one closes its connection (the backend sees
        the client go away and aborts the request)."""
        if not self._done:
            self._done = True
            self._conn.close()


class UpstreamPool:
    """Keep-alive connections per (scheme, host, port)."""

    def __init__(
        self, connect_timeout: float = 5.0, max_idle_per_host: int = 128, ssl_context: _ssl.SSLContext | None = None
    ):
        self.connect_timeout = connect_timeout
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple, list[_Connection]] = {}
        self._ssl = ssl_context  # https:// backends (None: the system's CAs, made on first use)
        self._closed = False

    @staticmethod
    def key_of(base_url: str) -> tuple:
        u = urlsplit(base_url)
        port = u.port or (443 if u.scheme == "https" else 80)
        return (u.scheme, u.hostname, port)

    async def _connect(self, key: tuple) -> _Connection:
        scheme, host, port = key
        ssl = None
        if scheme == "https":
            ssl = self._ssl = self._ssl or _ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key), host, port, ssl=ssl), self.connect_timeout
            )
        except asyncio.TimeoutError:
            raise ConnectFailed(f"connect to {host}:{port} timed out") from None
        except OSError as e:
            raise ConnectFailed(f"connect to {host}:{port} failed: {e}") from e
        return conn

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if self._closed or len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn._reset()
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def request(
        self, method: str, base_url: str, path: str, headers: list[tuple[str, str]], body: bytes = b""
    ) -> UpstreamResponse:
        """Send the request and wait for the response headers."""
        key = self.key_of(base_url)
        host_header = f"{key[1]}:{key[2]}"
        head = [f"{method} {path} HTTP/1.1", f"host: {host_header}", f"content-length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        idle = self._idle.get(key)
        while idle:  # most recently used first
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            try:
                return await self._send(conn, data)
            except ConnectionLost:
                if conn.got_bytes:  # the backend did answer something: real
                    raise
                # a kept-alive connection the server had closed: try a fresh one
        return await self._send(await self._connect(key), data)

    async def _send(self, conn: _Connection, data: bytes) -> UpstreamResponse:
        conn.used += 1
        conn.head = asyncio.get_running_loop().create_future()
        conn.transport.write(data)
        try:
            status = await conn.head
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(conn, status)

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for c in list(conns):
                c.close()
        self._idle.clear()
