"""/openapi.json as the server answers: what each operation declares beyond its route's own `responses`.

- the error statuses any operation can answer, from the middleware and the app's handlers: 400 (a malformed
  request or body), 401 (--api-key), 408 and 413 (--read-timeout, --max-request-body-bytes), 500; with a
  model behind it (a route that takes the `State`): 404 (an unknown model; with --models-dir one not in the
  folder) and 503 (not ready, loading, draining, engine dead); a POST with a model behind it also 429 (the
  waiting queue is full) and 504 (--request-timeout);
- each with the error model of the API its path belongs to: OpenAI's, Anthropic's on /v1/messages*, Ollama's
  `{"error": "..."}` on /api/* (llmserve/errors.py's shapes);
- no 422: FastAPI's validation errors are answered as 400s (app.py);
- the media type of a streamed answer beside the JSON one: `text/event-stream` (SSE) on the OpenAI and
  Anthropic routes that take `stream`, `application/x-ndjson` on Ollama's (STREAMED).

tests/e2e/test_openapi_truth.py walks the running app's operations and fails on a status or a content type
that the schema does not declare."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from llmserve.errors import is_anthropic_path, is_ollama_path
from llmserve.server import protocol as P
from llmserve.server.api.messages import AnthropicErrorResponse
from llmserve.server.api.ollama_render import NDJSON
from llmserve.server.state import server_state

SSE = "text/event-stream"
# path -> the media type of its streamed answer (`stream: true`)
STREAMED = {
    "/v1/chat/completions": SSE,
    "/v1/completions": SSE,
    "/v1/responses": SSE,
    "/v1/messages": SSE,
    "/api/chat": NDJSON,
    "/api/generate": NDJSON,
    "/api/pull": NDJSON,
}
ANY = (400, 401, 408, 413, 500)  # every operation
WITH_MODEL = (404, 503)  # an operation with a model behind it
GENERATING = (429, 504)  # a POST with a model behind it
DESCRIPTIONS = {
    400: "Bad Request: a malformed request, body or field",
    401: "Unauthorized: a missing or wrong API key (--api-key)",
    404: "Not Found: an unknown model or object",
    408: "Request Timeout: the body did not arrive within --read-timeout",
    409: "Conflict",
    413: "Content Too Large: the body is over --max-request-body-bytes",
    429: "Too Many Requests: the waiting queue is full (Retry-After)",
    500: "Internal Server Error",
    503: "Service Unavailable: the model is not ready (loading, draining or its engine stopped)",
    504: "Gateway Timeout: the request ran past --request-timeout",
}


class OllamaErrorResponse(BaseModel):
    """Ollama's error body."""

    error: str


def _error_model(path: str) -> type[BaseModel]:
    if is_anthropic_path(path):
        return AnthropicErrorResponse
    if is_ollama_path(path):
        return OllamaErrorResponse
    return P.ErrorResponse


def _statuses(route: APIRoute, method: str) -> tuple[int, ...]:
    """The error statuses `route` can answer to `method` (see the module's docstring)."""
    with_model = any(d.call is server_state for d in route.dependant.dependencies) or "{" in route.path
    out = ANY + (WITH_MODEL if with_model else ())
    return out + (GENERATING if with_model and method == "post" else ())


def declare(schema: dict, routes) -> dict:
    """`schema` (FastAPI's) with every operation's statuses, error models and streamed media types declared."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (P.ErrorResponse, OllamaErrorResponse, AnthropicErrorResponse):
        defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(defs.pop("$defs", {}))
        components[model.__name__] = defs
    for route in routes:
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        ref = {"$ref": f"#/components/schemas/{_error_model(route.path).__name__}"}
        for method in route.methods:
            op = schema["paths"].get(route.path_format, {}).get(method.lower())
            if op is None:
                continue
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in sorted({*_statuses(route, method.lower()), *(int(s) for s in responses if s.isdigit())}):
                if status < 400:
                    continue
                answer = responses.setdefault(str(status), {"description": DESCRIPTIONS.get(status, "Error")})
                answer["content"] = {"application/json": {"schema": ref}}
            if route.path in STREAMED:
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})[STREAMED[route.path]] = {
                    "schema": {"type": "string", "description": "the answer streamed (stream: true)"}
                }
    for unused in ("HTTPValidationError", "ValidationError"):
        if unused not in str(schema["paths"]):
            components.pop(unused, None)
    return schema


def install(app: FastAPI, routes: list) -> None:
    """Make app.openapi() answer the declared schema (built once, on the first call); `routes`: the APIs'."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                openapi_version=app.openapi_version,
                description=app.description,
                routes=app.routes,
                separate_input_output_schemas=app.separate_input_output_schemas,
            )
            app.openapi_schema = declare(schema, routes)
        return app.openapi_schema

    app.openapi = openapi
