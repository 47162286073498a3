"""OpenAI's Files and Batches APIs on `llmserve serve --batch-dir DIR`, driven by the official openai client:
upload, create, poll, download the output and error files, list, cancel, refusals in OpenAI's shape, and a
batch that survives its server's death (resumed by the next server on the same folder)."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from llmserve.testing.launcher import ServerProcess

KEY = "batch-key"
FLAGS = ("--api-key", KEY, "--max-model-len", "512", "--kv-cache-memory", "0.25")


def _chat(cid: str, text: str, max_tokens: int = 4, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **extra}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _jsonl(lines) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _wait(client, batch_id: str, statuses=("completed", "failed", "cancelled"), timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {b.status}")


def _results(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(*FLAGS, "--max-num-seqs", "4", "--batch-dir", str(tmp_path_factory.mktemp("batches")))
    try:
        yield srv.wait_ready(headers={"Authorization": f"Bearer {KEY}"})
    finally:
        srv.kill()


@pytest.fixture()
def client(server):
    return _client(server)


def test_a_batch_from_upload_to_results(client):
    lines = [_chat(f"q{i}", f"Name a color number {i}.") for i in range(3)]
    lines.append(_chat("bad", "hi", temperature=9))
    f = client.files.create(file=("requests.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "batch" and f.filename == "requests.jsonl"
    assert f.bytes == len(_jsonl(lines))
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "colors"}
    )
    assert b.id.startswith("batch_") and b.object == "batch" and b.status in ("validating", "in_progress")
    assert b.metadata == {"job": "colors"} and b.input_file_id == f.id
    b = _wait(client, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (4, 3, 1)
    assert b.in_progress_at and b.completed_at and b.completed_at >= b.created_at
    out = _results(client, b.output_file_id)
    assert [r["custom_id"] for r in out] == ["q0", "q1", "q2"]  # the input's order
    errors = _results(client, b.error_file_id)
    assert [r["custom_id"] for r in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "temperature"
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    for r in out:  # what the same request gets over HTTP (greedy)
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200
        body = next(x for x in lines if x["custom_id"] == r["custom_id"])["body"]
        direct = client.chat.completions.create(model="", **body)
        assert r["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content


def test_completions_and_embeddings_batches(client):
    text = [{"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "Once upon", "max_tokens": 3}}]
    emb = [{"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "hello"}}]
    for endpoint, lines, key in (("/v1/completions", text, "choices"), ("/v1/embeddings", emb, "data")):
        f = client.files.create(file=("x.jsonl", _jsonl(lines)), purpose="batch")
        b = _wait(client, client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h").id)
        assert b.status == "completed" and b.error_file_id is None
        (r,) = _results(client, b.output_file_id)
        assert r["custom_id"] == lines[0]["custom_id"] and r["response"]["body"][key]


def test_files_api(client, server):
    data = _jsonl([_chat("a", "hi")])
    f = client.files.create(file=("a.jsonl", data), purpose="batch")
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == data
    assert f.id in [x.id for x in client.files.list().data]
    assert f.id in [x.id for x in client.files.list(purpose="batch").data]
    assert f.id not in [x.id for x in client.files.list(purpose="batch_output").data]
    deleted = client.files.delete(f.id)
    assert deleted.id == f.id and deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    with pytest.raises(openai.BadRequestError, match="line 2"):  # not a batch file
        client.files.create(file=("b.jsonl", data + b"{oops\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="not unique"):
        client.files.create(file=("b.jsonl", data + data), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("b.jsonl", data), purpose="fine-tune")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).files.list()


def test_batch_refusals(client):
    f = client.files.create(file=("a.jsonl", _jsonl([_chat("a", "hi")])), purpose="batch")
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["param"] == "file_id"
    with pytest.raises(openai.BadRequestError, match="endpoint"):  # not an endpoint a batch can use
        client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="differs from the batch's endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")


def test_cancel_and_list(client):
    small = client.files.create(file=("one.jsonl", _jsonl([_chat("one", "hi")])), purpose="batch")
    finished = _wait(
        client,
        client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h").id,
    )
    with pytest.raises(openai.ConflictError):  # finished batches stay as they are
        client.batches.cancel(finished.id)
    lines = [_chat(f"c{i}", f"Count to {i}.", max_tokens=16) for i in range(40)]
    f = client.files.create(file=("many.jsonl", _jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    b = _wait(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    done = b.request_counts.completed + b.request_counts.failed
    assert done < 40 and len(_results(client, b.output_file_id)) == b.request_counts.completed
    page = client.batches.list(limit=1)
    assert [x.id for x in page.data] == [b.id] and page.has_more  # newest first
    rest = client.batches.list(limit=100, after=b.id).data
    assert b.id not in [x.id for x in rest] and finished.id in [x.id for x in rest]
    assert [x.id for x in client.batches.list(limit=100)] == [b.id] + [x.id for x in rest]  # auto-paged


def test_a_batch_survives_its_server(tmp_path):
    """The server dies (SIGKILL) in the middle of a batch; the next one on the same folder finishes it without
    sending again the lines already answered, and keeps the files."""
    lines = [_chat(f"r{i}", f"Say {i}.", max_tokens=8) for i in range(24)]
    first = ServerProcess(*FLAGS, "--max-num-seqs", "2", "--batch-dir", str(tmp_path))
    with first:
        client = _client(first.wait_ready())
        f = client.files.create(file=("r.jsonl", _jsonl(lines)), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while client.batches.retrieve(b.id).request_counts.completed < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        first.kill()
    assert (tmp_path / "batches" / f"{b.id}.partial.jsonl").exists()
    answered = len((tmp_path / "batches" / f"{b.id}.partial.jsonl").read_text().splitlines())
    assert 3 <= answered < 24
    with ServerProcess(*FLAGS, "--batch-dir", str(tmp_path)) as second:
        client = _client(second.wait_ready())
        assert client.files.retrieve(f.id).bytes == len(_jsonl(lines))
        b = _wait(client, b.id)
        assert b.status == "completed" and b.request_counts.completed == 24
        out = _results(client, b.output_file_id)
        assert [r["custom_id"] for r in out] == [x["custom_id"] for x in lines]
        sent = second.log().count("chatcmpl-")  # request log lines of the second server: the rest only
        assert 0 < sent <= 24 - answered + 2
