"""`llmserve run-batch` as a real process on the bundled model: a small OpenAI batch file (a chat completion,
a text completion, an embedding, a malformed line, an invalid request) read from a file, the results
written to stdout, one line per request line in the input's order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from llmserve.testing.launcher import ROOT

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


def test_run_batch_process(tmp_path):
    src = tmp_path / "requests.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in LINES) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "run-batch", "-i", str(src), "-o", "-"]
        + ["--num-threads", "1", "--max-model-len", "512", "--kv-cache-memory", "0.25", "--max-num-seqs", "4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
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
