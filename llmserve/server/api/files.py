"""OpenAI's Files API, for batch files: POST /v1/files (multipart: `file`, `purpose` "batch"), GET /v1/files,
GET /v1/files/{file_id}, GET /v1/files/{file_id}/content, DELETE /v1/files/{file_id}.

Files are kept under --batch-dir (llmserve/server/batch_store.py); without it every route answers 404
saying so. An upload is at most --max-batch-file-bytes and must be a valid batch file (JSONL, one request
a line, each custom_id unique). The multipart body is read here (no python-multipart dependency).
"""

from __future__ import annotations

from email.message import Message
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from llmserve.server import protocol as P
from llmserve.server.batch_store import BatchStore
from llmserve.server.errors import APIError
from llmserve.server.state import State

router = APIRouter()


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class ListPage(BaseModel):
    """OpenAI's cursor page (its `data` in each subclass): batch_store._page builds them."""

    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileList(ListPage):
    data: list[FileObject]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def store(state) -> BatchStore:
    """The server's BatchStore, or a 404 that says how to turn the Files and Batches APIs on."""
    if state.batches is None:
        raise APIError(
            404,
            "the Files and Batches APIs are off on this server: start it with --batch-dir DIR to keep files and "
            "batches there",
            code="batches_disabled",
        )
    return state.batches


def _params(header: str) -> tuple[str, dict[str, str]]:
    m = Message()
    m["content-type"] = header
    params = m.get_params() or [("", "")]
    return params[0][0].lower(), {k.lower(): v for k, v in params[1:]}


def parse_multipart(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body: {field name: (filename or None, value)}; a 400 when it is not one."""
    kind, params = _params(content_type)
    boundary = params.get("boundary")
    if kind != "multipart/form-data" or not boundary:
        raise APIError(400, "the body must be multipart/form-data with a `file` and a `purpose`", code="invalid_body")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for raw in body.split(b"--" + boundary.encode("latin-1"))[1:]:
        if raw.startswith(b"--"):  # the closing delimiter
            break
        raw = raw[2:] if raw.startswith(b"\r\n") else raw
        head, sep, value = raw.partition(b"\r\n\r\n")
        if not sep:
            raise APIError(400, "the multipart body has a part without headers", code="invalid_body")
        disposition = next(
            (h.split(b":", 1)[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-disposition:")), b""
        )
        _, dparams = _params("form-data; " + disposition.decode("latin-1").split(";", 1)[-1])
        if "name" in dparams:
            value = value[:-2] if value.endswith(b"\r\n") else value
            fields[dparams["name"]] = (dparams.get("filename"), value)
    return fields


_UPLOAD = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


@router.post("/v1/files", response_model=FileObject, responses=P.ERROR_RESPONSES, openapi_extra=_UPLOAD)
async def upload_file(request: Request, state: State):
    s = store(state)
    fields = parse_multipart(await request.body(), request.headers.get("content-type", ""))
    if "file" not in fields:
        raise APIError(400, "file: missing (send the batch file as the multipart field `file`)", param="file")
    if "purpose" not in fields:
        raise APIError(400, "purpose: missing (send purpose=batch)", param="purpose")
    filename, data = fields["file"]
    purpose = fields["purpose"][1].decode("utf-8", errors="replace").strip()
    return s.add_file(filename or "upload.jsonl", purpose, data)


@router.get("/v1/files", response_model=FileList, responses=P.ERROR_RESPONSES)
async def list_files(
    state: State,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = Query(default=10000, ge=1, le=10000),
    order: Literal["asc", "desc"] = "desc",
):
    return store(state).list_files(purpose, after, limit, order)


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=P.ERROR_RESPONSES)
async def retrieve_file(file_id: str, state: State):
    return store(state).file(file_id)


@router.get(
    "/v1/files/{file_id}/content",
    response_class=Response,
    responses={200: {"content": {"application/jsonl": {}}}, **P.ERROR_RESPONSES},
)
async def file_content(file_id: str, state: State):
    return Response(store(state).content(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=P.CONFLICT_RESPONSES)
async def delete_file(file_id: str, state: State):
    s = store(state)
    used = [b["id"] for b in s.batches.values() if b["input_file_id"] == file_id and b["id"] in s.tasks]
    if used:
        raise APIError(409, f"file {file_id!r} is the input of the running batch {used[0]}", code="conflict")
    return s.delete_file(file_id)
