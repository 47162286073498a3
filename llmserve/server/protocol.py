"""The protocol pieces the APIs share, as pydantic models: the request base (unknown fields ignored, as
OpenAI's API ignores them; values checked for type and range so that every bad request gets a 400 naming
the field), chat messages, vLLM's sampling extras, the chat and completions sampling fields, usage, and
OpenAI's error shape (ERROR_RESPONSES: the routes' documented errors). Each API's own request and
response shapes are in its module (llmserve/server/api/).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

MAX_N = 16
MAX_STOP = 8


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class APIModel(BaseModel):
    """A request body (or a part of one): unknown fields ignored, inf and nan refused."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(APIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(APIModel):
    type: Literal["text"] = "text"
    text: str


class ImageURL(APIModel):
    url: str  # a data: URL, or http(s) from a host in --allowed-media-domains (llmserve/server/media.py)
    detail: str | None = None


class ImagePart(APIModel):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL
    # where a 400 about it points, when an API names it otherwise than its content part (Ollama's images[j])
    _where: str | None = PrivateAttr(default=None)

    @classmethod
    def named(cls, url: str, where: str) -> ImagePart:
        part = cls(image_url=ImageURL(url=url))
        part._where = where
        return part


class ChatMessage(APIModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[Union[TextPart, ImagePart]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class EngineExtras(APIModel):
    """vLLM's sampling and structured-output extras, accepted by every generating API (the Responses and
    Messages APIs too, where clients send them as extra body fields)."""

    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output (docs/structured-output.md)
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: each prompt token's logprob and the top-N at its position, in the answer's `prompt_logprobs`
    # (its most: the engine's --max-logprobs)
    prompt_logprobs: int | None = Field(default=None, ge=0)


class SamplingFields(EngineExtras):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # token id (a string, as JSON keys are) -> a bias in [-100, 100] added to its logit (SamplingParams checks it)
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v


# -- responses (documented in the OpenAPI schema) ---------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: Union[int, str, None] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


# the error answers each route documents (for /openapi.json)
ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}
CONFLICT_RESPONSES = {**ERROR_RESPONSES, 409: {"model": ErrorResponse}}  # the Files and Batches APIs' 409
