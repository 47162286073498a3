"""OpenAI's batch files, run through the server's own app: `llmserve run-batch` and the Batches API
(api/batches.py, batch_store.py) share this module.

A batch file holds one request a line, `{"custom_id", "method": "POST", "url", "body"}`; each line is
sent, in the process, to the app's route for its `url` (an httpx client over ASGITransport: the same
validation, admission and rendering as over HTTP, no twin of the request handling), up to `concurrency`
lines at a time so that the engine batches them. Each line gets one result line in OpenAI's batch
output format, `{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}`; a malformed line gets `"response": null, "error": {"code", "message"}`. One bad line
never stops the others, and results keep the input's order.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

import httpx

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# the `priority` batch lines run at inside `llmserve serve` (lower runs first under --scheduling-policy
# priority; interactive requests default to 0), unless a line's body names its own
BATCH_PRIORITY = 1 << 20
QUEUE_FULL_RETRIES = 30  # a line refused with 429 (--max-queued-requests) is sent again, after Retry-After


@dataclass
class BatchLine:
    """One line of a batch file: `index` (0-based, its place in the file), and either the request
    (`custom_id`, `url`, `body`) or `error` ({"code", "message"}: the line is malformed)."""

    index: int
    custom_id: str | None = None
    url: str | None = None
    body: dict | None = None
    error: dict | None = None


def _bad(index: int, code: str, message: str, custom_id=None) -> BatchLine:
    cid = custom_id if isinstance(custom_id, str) else None
    return BatchLine(index, cid, error={"code": code, "message": f"line {index + 1}: {message}"})


def parse_line(index: int, text: str, endpoint: str | None = None) -> BatchLine:
    """A batch file's line `index` (its text): a request, or a BatchLine with `error` saying what is wrong
    (not JSON, not an object, no custom_id, a method other than POST, a url not served or not `endpoint`,
    a body that is not an object)."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return _bad(index, "invalid_json", f"not valid JSON ({e})")
    if not isinstance(obj, dict):
        return _bad(index, "invalid_request", "must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return _bad(index, "missing_custom_id", "custom_id: must be a non-empty string", cid)
    if obj.get("method", "POST") != "POST":
        return _bad(index, "invalid_method", f"method: must be POST, got {obj.get('method')!r}", cid)
    url = obj.get("url")
    if url not in ENDPOINTS:
        return _bad(index, "invalid_url", f"url: must be one of {', '.join(ENDPOINTS)}, got {url!r}", cid)
    if endpoint is not None and url != endpoint:
        return _bad(index, "mismatched_url", f"url: {url!r} differs from the batch's endpoint {endpoint!r}", cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        return _bad(index, "invalid_body", "body: must be a JSON object", cid)
    return BatchLine(index, cid, url, body)


def parse_lines(text: str, endpoint: str | None = None) -> list[BatchLine]:
    """Every non-blank line of a batch file's text, numbered as in the file."""
    return [parse_line(i, line, endpoint) for i, line in enumerate(text.splitlines()) if line.strip()]


def check_lines(lines: list[BatchLine], limit: int = 5) -> list[dict]:
    """What makes a file unfit for the Batches API: its malformed lines and repeated custom_ids (up to
    `limit` of them, as {"code", "message", "line"}); an empty file is one error too."""
    errors, seen = [], set()
    if not lines:
        errors.append({"code": "empty_file", "message": "the file holds no requests", "line": None})
    for line in lines:
        if line.error is not None:
            errors.append({**line.error, "line": line.index + 1})
        elif line.custom_id in seen:
            errors.append(
                {
                    "code": "duplicate_custom_id",
                    "message": f"line {line.index + 1}: custom_id {line.custom_id!r} is not unique",
                    "line": line.index + 1,
                }
            )
        seen.add(line.custom_id)
    return errors[:limit]


def _req_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def result_line(line: BatchLine, status: int | None = None, body=None, request_id: str | None = None) -> dict:
    """The output line of `line`: its response (`status` and `body`), or its `error` when it is malformed."""
    if line.error is not None:
        return {"id": _req_id(), "custom_id": line.custom_id, "response": None, "error": line.error}
    response = {"status_code": status, "request_id": request_id or _req_id(), "body": body}
    return {"id": _req_id(), "custom_id": line.custom_id, "response": response, "error": None}


def succeeded(result: dict) -> bool:
    r = result.get("response")
    return result.get("error") is None and r is not None and 200 <= r["status_code"] < 300


def _error_body(status: int, message: str, code: str) -> dict:
    from llmserve.errors import error_body

    return error_body(status, message, code=code)


async def run_line(client: httpx.AsyncClient, line: BatchLine, priority: int | None = None) -> dict:
    """One line through the app (`client`): its result line. `priority`: the body's, unless it names one."""
    if line.error is not None:
        return result_line(line)
    body = dict(line.body)
    if body.get("stream"):
        msg = "stream: not supported in a batch (each line is answered whole)"
        return result_line(line, 400, _error_body(400, msg, "invalid_value"))
    if priority is not None and "priority" not in body:
        body["priority"] = priority
    try:
        for _ in range(QUEUE_FULL_RETRIES):
            r = await client.post(line.url, json=body)
            if r.status_code != 429:
                break
            await asyncio.sleep(_retry_after(r))
    except Exception as e:  # noqa: BLE001 - one line's failure is its result, never the batch's
        return result_line(line, 500, _error_body(500, f"internal error: {type(e).__name__}: {e}", "internal_error"))
    try:
        answer = r.json()
    except ValueError:
        answer = {"text": r.text}
    rid = answer.get("id") if isinstance(answer, dict) and isinstance(answer.get("id"), str) else None
    return result_line(line, r.status_code, answer, rid)


def _retry_after(r: httpx.Response) -> float:
    try:
        return min(30.0, max(0.05, float(r.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


async def run_lines(
    client: httpx.AsyncClient,
    lines: Iterable[BatchLine],
    concurrency: int,
    on_result: Callable[[BatchLine, dict], Awaitable[None] | None] | None = None,
    priority: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[int, dict]:
    """Every line through `client`, at most `concurrency` at a time: {line index: result line}.
    `on_result(line, result)` is called as each finishes (a progress bar, a store's record); once `stop()`
    is true no further line starts (those running finish), and the lines not started have no result."""
    sem = asyncio.Semaphore(max(1, concurrency))
    results: dict[int, dict] = {}

    async def one(line: BatchLine) -> None:
        async with sem:
            if stop is not None and stop():
                return
            result = await run_line(client, line, priority)
        results[line.index] = result
        if on_result is not None:
            done = on_result(line, result)
            if asyncio.iscoroutine(done):
                await done

    await asyncio.gather(*(one(line) for line in lines))
    return results


def in_process_client(app, api_keys: tuple[str, ...] = ()) -> httpx.AsyncClient:
    """An httpx client that calls `app` in this process (no socket), with the first accepted API key where
    the server has any (`Settings.api_keys()`: --api-key's and --api-key-file's)."""
    headers = {"Authorization": f"Bearer {api_keys[0]}"} if api_keys else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://llmserve-batch", headers=headers, timeout=None
    )


def read_partial(path: str) -> dict[int, dict]:
    """The results recorded so far in a partial file ({"index", "result"} a line): {line index: result line}.
    A missing file is none; a line cut short by a crash is skipped (its request runs again)."""
    done = {}
    try:
        with open(path, encoding="utf-8") as f:
            for text in f:
                try:
                    rec = json.loads(text)
                    done[int(rec["index"])] = rec["result"]
                except (ValueError, KeyError, TypeError):
                    pass
    except FileNotFoundError:
        pass
    return done


def record_partial(f, line: BatchLine, result: dict) -> None:
    """`line`'s result appended to an open partial file, flushed (what a crash leaves is kept)."""
    f.write(json.dumps({"index": line.index, "result": result}, ensure_ascii=False) + "\n")
    f.flush()


@asynccontextmanager
async def running_app(app):
    """`app` started (its lifespan: the engine loads) and stopped around the block."""
    async with app.router.lifespan_context(app):
        yield app
