"""The router's own answers, in OpenAI's error shape (llmserve/errors.py), sent over raw ASGI."""
from __future__ import annotations

import json

from llmserve.errors import error_body


class RouterError(Exception):
    """An answer the router gives itself, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def payload(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code, self.type)

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()


async def send_error(send, err: RouterError) -> None:
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
