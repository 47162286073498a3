"""The router's own answers, in OpenAI's error shape, or Anthropic's on /v1/messages (llmserve/errors.py),
sent over raw ASGI."""

from __future__ import annotations

import json

from llmserve.errors import error_body_for, is_anthropic_path, is_ollama_path


class RouterError(Exception):
    """An answer the router gives itself, in the shape of the API the request's path belongs to."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def payload(self, path: str = "") -> dict:
        return error_body_for(path, self.status, self.message, self.param, self.code, self.type)

    def body(self, path: str = "") -> bytes:
        return json.dumps(self.payload(path)).encode()

    def sse(self, path: str = "") -> bytes:
        """The error as a stream event: OpenAI's `data:` event, Anthropic's `event: error`, or Ollama's NDJSON line."""
        if is_ollama_path(path):
            return self.body(path) + b"\n"
        head = b"event: error\n" if is_anthropic_path(path) else b""
        return head + b"data: " + self.body(path) + b"\n\n"


async def send_error(send, err: RouterError, path: str = "") -> None:
    body = err.body(path)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
