"""Runtime LoRA adapters, as vLLM's: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, offered only
with LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING (`enabled`); the adapters themselves are the engine's
(llmserve/engine/lora.py, --enable-lora).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from llmserve import envs
from llmserve.server import protocol as P
from llmserve.server.errors import APIError, from_value_error
from llmserve.server.state import ServerState, State

router = APIRouter()


def enabled(state: ServerState) -> bool:
    return envs.LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _registry(state: ServerState):
    state.engine_or_503()
    if state.lora is None:
        raise APIError(
            400,
            "LoRA adapters are not enabled on this server (start it with --enable-lora)",
            code="lora_not_enabled",
        )
    return state.lora


@router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    responses=P.ERROR_RESPONSES,
    summary="Load a LoRA adapter (a PEFT folder) under a name",
)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: State):
    lora = _registry(state)
    try:
        await asyncio.to_thread(lora.load, body.lora_name, body.lora_path)
    except ValueError as e:
        raise from_value_error(e) from e
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses=P.ERROR_RESPONSES,
    summary="Unload a LoRA adapter (requests running with it finish first)",
)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: State):
    lora = _registry(state)
    try:
        lora.unload(body.lora_name)
    except KeyError:
        raise APIError(
            404, f"the LoRA adapter {body.lora_name!r} is not loaded", param="lora_name", code="model_not_found"
        ) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
