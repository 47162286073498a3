"""GET /v1/models: the base model (each of its --served-model-name names), then the loaded LoRA adapters (each
with its `parent`, as vLLM lists them); GET /v1/models/{id}: one of them, or a 404 as OpenAI answers.

With --models-dir, every model of the folder, loaded or not: `status` is {"value": "loaded" | "not loaded" |
"loading" | "unloading" | "failed", "error": ... when it failed} (as llama-server's router mode lists them)."""

from __future__ import annotations

import time

from fastapi import APIRouter
from pydantic import BaseModel, Field

from llmserve.server import protocol as P
from llmserve.server.errors import APIError
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
    status: dict = Field(default_factory=lambda: {"value": "loaded"})  # --models-dir: loaded or not, failed


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


def _cards(state) -> list[ModelCard]:
    if state.models is not None:
        cards = []
        for slot in state.models.slots.values():
            cards.append(ModelCard(**slot.card()))
            cards += _adapter_cards(slot.state) if slot.state.engine is not None else []
        return cards
    eng = state.engine_or_503()
    return [
        ModelCard(id=n, root=eng.engine.model_path, max_model_len=eng.engine.max_model_len) for n in state.model_names
    ] + _adapter_cards(state)


def _adapter_cards(state) -> list[ModelCard]:
    eng = state.engine
    cards = []
    for a in state.lora.adapters() if state.lora is not None else ():
        cards.append(
            ModelCard(id=a.name, root=a.path, parent=state.model_names[0], max_model_len=eng.engine.max_model_len)
        )
    return cards


@router.get("/v1/models", response_model=ModelList, responses=P.ERROR_RESPONSES)
async def models(state: State):
    return ModelList(data=_cards(state))


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=P.ERROR_RESPONSES)
async def model(model: str, state: State):
    for card in _cards(state):
        if card.id == model:
            return card
    raise APIError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
