"""uvicorn's httptools protocol with two limits it lacks: request headers must arrive within a
timeout (slowloris, and connections opened and left idle before their first request), and their total
size is capped. Bodies are timed by GuardMiddleware (llmserve/server/middleware.py)."""

from __future__ import annotations

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - without httptools uvicorn uses h11, which caps header size itself
    HttpToolsProtocol = None


def http_protocol(header_timeout: float, max_header_bytes: int):
    """The `http` setting for uvicorn.Config: our protocol class, or "auto" without httptools."""
    if HttpToolsProtocol is None:
        return "auto"

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._hdr_bytes = 0
            self._hdr_timer = None
            self._arm()

        def _arm(self) -> None:
            if self._hdr_timer is None and header_timeout:
                self._hdr_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._hdr_timer is not None:
                self._hdr_timer.cancel()
                self._hdr_timer = None

        def _headers_too_slow(self) -> None:
            self._hdr_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def _count(self, n: int) -> None:
            self._hdr_bytes += n
            if self._hdr_bytes > max_header_bytes:  # -> HttpParserError -> 400 and close
                raise httptools.HttpParserError("request headers too large")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._hdr_bytes = 0
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol
