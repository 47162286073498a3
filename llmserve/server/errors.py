"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status."""
from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    500: "internal_server_error", 503: "service_unavailable", 504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type or _TYPES.get(status, "api_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


_FIELD_RE = re.compile(r"^(\w+)\s*:")


def from_value_error(e: ValueError) -> APIError:
    """The engine's ValueErrors start with the field they are about: "top_p: must be ..."."""
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
            return APIError(400, f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}",
                            code="invalid_json")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return APIError(400, "; ".join(parts) or "invalid request", param=param, code="invalid_value")
