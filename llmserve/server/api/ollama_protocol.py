"""Ollama's request bodies (pydantic models, in the OpenAPI schema): /api/chat's and /api/generate's (their shared
fields in `GeneratingRequest`), /api/embed's, the legacy /api/embeddings', and the name-only bodies of /api/show and
/api/pull."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field

from llmserve.server import protocol as P
from llmserve.server.errors import APIError

KeepAlive = Union[int, float, str, None]


class OllamaMessage(P.APIModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class GeneratingRequest(P.APIModel):
    model: str
    format: Union[Literal["", "json"], dict[str, Any], None] = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: Union[bool, Literal["high", "medium", "low"], None] = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # its most: --max-logprobs

    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: the top-N alternatives with each token's logprob, or None."""
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatRequest(GeneratingRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(GeneratingRequest):
    prompt: str = ""
    system: str | None = None
    suffix: str | None = None
    images: list[str] | None = None
    raw: bool = False
    template: str | None = None
    context: list[int] | None = None


class EmbedRequest(P.APIModel):
    model: str
    input: Union[str, list[str]]
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class LegacyEmbeddingsRequest(P.APIModel):
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class NameRequest(P.APIModel):
    model: str | None = None
    name: str | None = None  # the older field name
    stream: bool = True

    def which(self) -> str:
        if not (self.model or self.name):
            raise APIError(400, "model: is required", param="model")
        return self.model or self.name
