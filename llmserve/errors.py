"""The error shapes, the one builder of each in the package.

- OpenAI's, on every OpenAI-style endpoint: {"error": {"message", "type", "param", "code"}}.
- Anthropic's, on /v1/messages and its sub-paths: {"type": "error", "error": {"type", "message"}}, with
  Anthropic's type names per status.
- Ollama's, on its API under /api/: {"error": "message"}.

No heavy imports (no FastAPI, no engine): the server, the router and the fake servers all use it.
"""

from __future__ import annotations

# the `type` OpenAI gives each status; a caller may name another (the router's 502 is "bad_gateway")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# Anthropic's names (docs: "HTTP errors"); other 4xx are invalid_request_error, other 5xx api_error
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

ANTHROPIC_PATH = "/v1/messages"
OLLAMA_PREFIX = "/api/"


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error")


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None, type: str | None = None
) -> dict:
    """The JSON body of an error answer (or of an SSE `data:` event): `type` defaults from `status`."""
    return {"error": {"message": message, "type": type or error_type(status), "param": param, "code": code}}


def anthropic_error_type(status: int) -> str:
    return ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error body (also the data of a stream's `event: error`); the type follows the status."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def is_anthropic_path(path: str) -> bool:
    """Paths that answer errors in Anthropic's shape: /v1/messages and /v1/messages/count_tokens."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def is_ollama_path(path: str) -> bool:
    """Ollama's API (/api/chat, /api/generate, ...): errors are {"error": "message"}."""
    return path.startswith(OLLAMA_PREFIX)


def error_body_for(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | int | None = None,
    type: str | None = None,
) -> dict:
    """The error body in the shape of the API that `path` belongs to."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message)
    if is_ollama_path(path):
        return {"error": message}
    return error_body(status, message, param, code, type)
