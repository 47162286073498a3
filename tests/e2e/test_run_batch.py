"""`llmserve run-batch` as a real process on the bundled model: a small OpenAI batch file (a chat completion,
a text completion, an embedding, a malformed line, an invalid request) read from a file, the results
written to stdout, one line per request line in the input's order, the same answers as `llmserve serve`
gives over HTTP; and a run resumed from the partial file a stopped run left."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from llmserve.testing.launcher import ROOT, ServerProcess

FLAGS = ["--num-threads", "1", "--max-model-len", "512", "--kv-cache-memory", "0.25", "--max-num-seqs", "4"]

LINES = [
    {
        "custom_id": "chat-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0},
    },
    {
        "custom_id": "text-1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
    },
    {"custom_id": "embed-1", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["hello", "world"]}},
    "this line is not JSON",
    {
        "custom_id": "invalid-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 9},
    },
]


def _run_batch(tmp_path, output: str) -> subprocess.CompletedProcess:
    src = tmp_path / "requests.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in LINES) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "run-batch", "-i", str(src), "-o", output] + FLAGS,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_run_batch_process(tmp_path):
    proc = _run_batch(tmp_path, "-")
    out = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout holds the results and nothing else
    assert [r["custom_id"] for r in out] == ["chat-1", "text-1", "embed-1", None, "invalid-1"]
    assert all(r["id"].startswith("batch_req_") for r in out)
    chat, text, embed, malformed, invalid = out
    for r in (chat, text, embed):
        assert r["error"] is None and r["response"]["status_code"] == 200, r
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["request_id"] == chat["response"]["body"]["id"]
    assert chat["response"]["body"]["usage"]["completion_tokens"] <= 4
    assert chat["response"]["body"]["choices"][0]["message"]["content"]
    assert text["response"]["body"]["object"] == "text_completion"
    assert text["response"]["body"]["choices"][0]["text"]
    vectors = [d["embedding"] for d in embed["response"]["body"]["data"]]
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 0
    assert malformed["response"] is None and malformed["error"]["code"] == "invalid_json"
    assert "line 4" in malformed["error"]["message"]
    assert invalid["error"] is None and invalid["response"]["status_code"] == 400
    assert invalid["response"]["body"]["error"]["param"] == "temperature"
    assert "5 requests, 3 succeeded, 2 failed" in proc.stderr
    srv = ServerProcess(*FLAGS)  # the same lines over HTTP: the same greedy answers
    try:
        srv.wait_ready()
        for r, line in ((chat, LINES[0]), (text, LINES[1])):
            live = httpx.post(srv.url + line["url"], json=line["body"], timeout=60).json()
            got = r["response"]["body"]["choices"][0]
            want = live["choices"][0]
            assert (got.get("message"), got.get("text")) == (want.get("message"), want.get("text"))
            assert r["response"]["body"]["usage"] == live["usage"]
    finally:
        srv.kill()


def test_run_batch_resumes_from_its_partial_file(tmp_path):
    out = tmp_path / "results.jsonl"
    kept = {"id": "batch_req_kept", "custom_id": "chat-1", "response": {"status_code": 200, "body": {"k": 1}}}
    stale = {"id": "batch_req_x", "custom_id": "text-OLD", "response": {"status_code": 200, "body": {}}}
    failed = {"id": "batch_req_y", "custom_id": "embed-1", "response": {"status_code": 500, "body": {}}}
    recs = [{"index": 0, "result": kept}, {"index": 1, "result": stale}, {"index": 2, "result": failed}]
    # what a stopped run leaves: answers so far, the last line cut short
    partial = tmp_path / "results.jsonl.partial"
    partial.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"index": 4, "res')
    proc = _run_batch(tmp_path, str(out))
    assert "resuming: 1 of 5 lines answered" in proc.stderr
    assert not partial.exists()  # the whole output is written: nothing left to resume
    res = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in res] == ["chat-1", "text-1", "embed-1", None, "invalid-1"]
    assert res[0] == kept  # answered before: not sent again
    assert res[1]["response"]["body"]["object"] == "text_completion"  # its custom_id changed: sent again
    assert res[2]["response"]["status_code"] == 200 and res[2]["response"]["body"]["data"]  # a 5xx: sent again
    assert res[4]["response"]["status_code"] == 400  # the cut line: sent again
