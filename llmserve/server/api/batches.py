"""OpenAI's Batches API: POST /v1/batches, GET /v1/batches/{batch_id}, GET /v1/batches (`after`, `limit`),
POST /v1/batches/{batch_id}/cancel.

A batch's input is a file uploaded with purpose "batch" (api/files.py); it runs in the background of the
server through llmserve/server/batch.py (as `llmserve run-batch` does), its state kept under --batch-dir
(llmserve/server/batch_store.py: lower priority than interactive requests, resumed after a restart).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from llmserve.server import protocol as P
from llmserve.server.api.files import ListPage, store
from llmserve.server.state import State

router = APIRouter()


class BatchRequest(P.APIModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class BatchList(ListPage):
    data: list[BatchObject]


@router.post("/v1/batches", response_model=BatchObject, responses=P.ERROR_RESPONSES)
async def create_batch(body: BatchRequest, request: Request, state: State):
    s = store(state)
    b = s.create_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    s.launch(request.app, b["id"])
    return b


@router.get("/v1/batches", response_model=BatchList, responses=P.ERROR_RESPONSES)
async def list_batches(state: State, after: str | None = None, limit: int = Query(default=20, ge=1, le=100)):
    return store(state).list_batches(after, limit)


@router.get("/v1/batches/{batch_id}", response_model=BatchObject, responses=P.ERROR_RESPONSES)
async def retrieve_batch(batch_id: str, state: State):
    return store(state).batch(batch_id)


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, responses=P.CONFLICT_RESPONSES)
async def cancel_batch(batch_id: str, state: State):
    return store(state).cancel(batch_id)
