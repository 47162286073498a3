"""The Files and Batches APIs without a model: the routes' refusals (off without --batch-dir, sizes, purposes,
multipart bodies), the store's persistence and single owner, list pages, and a batch resumed from its partial
results (llmserve/server/batch_store.py) over a stand-in app."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from llmserve.serve_config import ServerSettings
from llmserve.server.api.files import parse_multipart
from llmserve.server.app import build_app
from llmserve.server.batch_store import BatchStore, _page
from llmserve.server.errors import APIError

LINE = {"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}}
DATA = (json.dumps(LINE) + "\n").encode()


def _call(app, *requests):
    """Each (method, path, kwargs) through `app` in the process (no lifespan: no model loads)."""

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.request(m, p, **kw) for m, p, kw in requests]

    return asyncio.run(go())


def test_without_batch_dir_the_apis_answer_404_saying_how_to_turn_them_on():
    app = build_app(ServerSettings())
    for r in _call(app, ("GET", "/v1/files", {}), ("POST", "/v1/batches", {"json": {}}), ("GET", "/v1/batches", {})):
        if r.status_code == 400:  # the body is checked first
            continue
        assert r.status_code == 404 and "--batch-dir" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "batches_disabled"


def test_uploads_checked_and_listed(tmp_path):
    app = build_app(ServerSettings(batch_dir=str(tmp_path), max_batch_file_bytes=5000, max_request_body_bytes=1000))
    big = DATA * (3000 // len(DATA))  # over the body limit, under the file limit: uploads get the file's
    too_big = DATA * (6000 // len(DATA))
    ok, large, huge, purpose, bad, plain, nofile = _call(
        app,
        ("POST", "/v1/files", {"files": {"file": ("a.jsonl", DATA)}, "data": {"purpose": "batch"}}),
        (
            "POST",
            "/v1/files",
            {"files": {"file": ("b.jsonl", big.replace(b'"a"', b'"x"', 1))}, "data": {"purpose": "batch"}},
        ),
        ("POST", "/v1/files", {"files": {"file": ("c.jsonl", too_big)}, "data": {"purpose": "batch"}}),
        ("POST", "/v1/files", {"files": {"file": ("d.jsonl", DATA)}, "data": {"purpose": "fine-tune"}}),
        ("POST", "/v1/files", {"files": {"file": ("e.jsonl", b"{nope\n")}, "data": {"purpose": "batch"}}),
        ("POST", "/v1/files", {"content": DATA, "headers": {"content-type": "application/jsonl"}}),
        ("POST", "/v1/files", {"files": {"other": ("a.jsonl", DATA)}, "data": {"purpose": "batch"}}),
    )
    assert ok.status_code == 200 and ok.json()["bytes"] == len(DATA) and ok.json()["filename"] == "a.jsonl"
    assert large.status_code == 400 and "not unique" in large.json()["error"]["message"]  # read whole, then checked
    assert huge.status_code == 413 and "--max-batch-file-bytes" in huge.json()["error"]["message"]
    assert purpose.status_code == 400 and purpose.json()["error"]["param"] == "purpose"
    assert bad.status_code == 400 and "line 1" in bad.json()["error"]["message"]
    assert plain.status_code == 400 and "multipart" in plain.json()["error"]["message"]
    assert nofile.status_code == 400 and nofile.json()["error"]["param"] == "file"
    fid = ok.json()["id"]
    listed, content, missing = _call(
        app, ("GET", "/v1/files", {}), ("GET", f"/v1/files/{fid}/content", {}), ("GET", "/v1/files/file-x", {})
    )
    assert [f["id"] for f in listed.json()["data"]] == [fid] and "created_ns" not in listed.json()["data"][0]
    assert content.content == DATA and missing.status_code == 404


def test_multipart_values_keep_their_bytes():
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="r.jsonl"\r\n'
        b'Content-Type: application/octet-stream\r\n\r\n{"a": "\xc3\xa9"}\r\n\n\r\n--XyZ--\r\n'
    )
    fields = parse_multipart(body, "multipart/form-data; boundary=XyZ")
    assert fields == {"purpose": (None, b"batch"), "file": ("r.jsonl", b'{"a": "\xc3\xa9"}\r\n\n')}
    with pytest.raises(APIError):
        parse_multipart(body, "multipart/form-data")


def test_state_survives_and_one_server_owns_a_folder(tmp_path):
    store = BatchStore(str(tmp_path), 10000, 2)
    f = store.add_file("a.jsonl", "batch", DATA)
    b = store.create_batch(f["id"], "/v1/chat/completions", "24h", {"k": "v"})
    with pytest.raises(ValueError, match="in use"):
        BatchStore(str(tmp_path), 10000, 2)
    asyncio.run(store.stop())  # lets the folder go
    again = BatchStore(str(tmp_path), 10000, 2)
    assert again.file(f["id"]) == f and again.batch(b["id"]) == b and again.content(f["id"]) == DATA
    with pytest.raises(APIError) as e:
        again.create_batch(f["id"], "/v1/completions", "24h", None)
    assert e.value.status == 400 and "differs" in e.value.message
    with pytest.raises(APIError) as e:
        again.create_batch("file-nope", "/v1/chat/completions", "24h", None)
    assert e.value.status == 404


def test_pages():
    objs = [{"id": str(i)} for i in range(5)]
    page = _page(objs, None, 2)
    assert [o["id"] for o in page["data"]] == ["0", "1"] and page["has_more"] and page["last_id"] == "1"
    page = _page(objs, "1", 10)
    assert [o["id"] for o in page["data"]] == ["2", "3", "4"] and not page["has_more"]
    assert _page(objs, "nope", 10)["data"] == []


def test_a_batch_resumes_from_its_partial_results(tmp_path):
    lines = [{**LINE, "custom_id": f"r{i}"} for i in range(5)]
    store = BatchStore(str(tmp_path), 10000, 2)
    f = store.add_file("r.jsonl", "batch", "".join(json.dumps(x) + "\n" for x in lines).encode())
    b = store.create_batch(f["id"], "/v1/chat/completions", "24h", None)
    b["status"] = "in_progress"
    done = {
        "index": 1,
        "result": {
            "id": "batch_req_1",
            "custom_id": "r1",
            "error": None,
            "response": {"status_code": 200, "request_id": "x", "body": {"n": "before"}},
        },
    }
    (tmp_path / "batches" / f"{b['id']}.partial.jsonl").write_text(json.dumps(done) + "\n{cut short")
    app, sent = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        sent.append(body)
        return {"id": f"chatcmpl-{len(sent)}", "n": len(sent)}

    app.state.llm = SimpleNamespace(ready=True, load_error=None, draining=False, api_keys=())
    asyncio.run(store._run(app, b["id"]))
    assert len(sent) == 4 and {s["priority"] for s in sent} == {1 << 20}
    assert b["status"] == "completed" and b["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    out = [json.loads(x) for x in store.content(b["output_file_id"]).decode().splitlines()]
    assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(5)]
    assert out[1]["response"]["body"] == {"n": "before"} and b["error_file_id"] is None
    assert not (tmp_path / "batches" / f"{b['id']}.partial.jsonl").exists()
    asyncio.run(store.stop())
    assert BatchStore(str(tmp_path), 10000, 2).batch(b["id"])["status"] == "completed"


def test_a_stopping_server_leaves_its_batch_in_progress(tmp_path):
    """SIGTERM: the lines refused with 503 while the server drains are not answers; the batch stays in progress."""
    lines = [{**LINE, "custom_id": f"r{i}"} for i in range(6)]
    store = BatchStore(str(tmp_path), 10000, 1)
    f = store.add_file("r.jsonl", "batch", "".join(json.dumps(x) + "\n" for x in lines).encode())
    b = store.create_batch(f["id"], "/v1/chat/completions", "24h", None)
    app = FastAPI()
    app.state.llm = state = SimpleNamespace(ready=True, load_error=None, draining=False, api_keys=())
    sent = []

    @app.post("/v1/chat/completions")
    async def chat():
        sent.append(1)
        if len(sent) >= 2:
            state.draining = True
            return JSONResponse({"error": {"message": "not ready"}}, status_code=503)
        return {"id": "chatcmpl-1"}

    asyncio.run(store._run(app, b["id"]))
    assert len(sent) == 2 and b["status"] == "in_progress" and b["output_file_id"] is None
    assert len((tmp_path / "batches" / f"{b['id']}.partial.jsonl").read_text().splitlines()) == 1
    assert b["request_counts"] == {"total": 6, "completed": 1, "failed": 0}
