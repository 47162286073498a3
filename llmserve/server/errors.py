"""The server's errors: APIError (raised anywhere, answered as JSON or as an SSE event) and the
conversions of pydantic's and the engine's ValueErrors. The shapes are llmserve/errors.py's: OpenAI's,
or Anthropic's on /v1/messages (an answer names the request's path to get its API's shape)."""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

from llmserve.errors import error_body_for, error_type


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type or error_type(status)

    def body(self, path: str = "") -> dict:
        return error_body_for(path, self.status, self.message, self.param, self.code, self.type)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """OpenAI's in-stream error: a `data:` event holding the error body."""
        return f"data: {json.dumps(self.body())}\n\n"


_FIELD_RE = re.compile(r"^(\w[\w.\[\]]*)\s*:")  # "top_p: ...", "input[2].role: ..."


def from_value_error(e: ValueError) -> APIError:
    """The engine's (and the converters') ValueErrors start with the field they are about: "top_p: must be ..."."""
    msg = str(e)
    m = _FIELD_RE.match(msg)
    return APIError(400, msg, param=m.group(1) if m else None, code="invalid_value")


def from_validation_errors(errors: list[dict]) -> APIError:
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        if err.get("type") == "json_invalid":
            return APIError(
                400, f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", code="invalid_json"
            )
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return APIError(400, "; ".join(parts) or "invalid request", param=param, code="invalid_value")
