"""OpenAI's error shape, the one builder of it in the package: {"error": {"message", "type", "param", "code"}}.

No heavy imports (no FastAPI, no engine): the server, the router and the fake servers all use it.
"""
from __future__ import annotations

# the `type` OpenAI gives each status; a caller may name another (the router's 502 is "bad_gateway")
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
    413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    500: "internal_server_error", 503: "service_unavailable", 504: "timeout_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error")


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None,
               type: str | None = None) -> dict:
    """The JSON body of an error answer (or of an SSE `data:` event): `type` defaults from `status`."""
    return {"error": {"message": message, "type": type or error_type(status), "param": param, "code": code}}
