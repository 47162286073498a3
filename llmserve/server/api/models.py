"""GET /v1/models: the base model, then the loaded LoRA adapters (each with its `parent`, as vLLM lists them)."""

from __future__ import annotations

import time

from fastapi import APIRouter
from pydantic import BaseModel, Field

from llmserve.server import protocol as P
from llmserve.server.state import State

router = APIRouter()


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (as vLLM lists adapters)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


@router.get("/v1/models", response_model=ModelList, responses=P.ERROR_RESPONSES)
async def models(state: State):
    eng = state.engine_or_503()
    cards = [
        ModelCard(id=n, root=eng.engine.model_path, max_model_len=eng.engine.max_model_len) for n in state.model_names
    ]
    for a in state.lora.adapters() if state.lora is not None else ():
        cards.append(
            ModelCard(id=a.name, root=a.path, parent=state.model_names[0], max_model_len=eng.engine.max_model_len)
        )
    return ModelList(data=cards)
