"""The Files and Batches APIs' state (api/files.py, api/batches.py), kept under --batch-dir, and the batches
run in the background of `llmserve serve`.

    DIR/files/file-<hex>.json       a file object (OpenAI's: id, bytes, created_at, filename, purpose, status)
    DIR/files/file-<hex>.jsonl      its content
    DIR/batches/batch_<hex>.json    a batch object (OpenAI's)
    DIR/batches/batch_<hex>.partial.jsonl   a running batch's results so far ({"index", "result"} a line)

Every object is written whole to a temporary file and renamed into place, so a crash leaves the old or
the new one. One server owns a folder at a time (an flock on DIR/.lock): a second one refuses to start.

A batch runs through the same module as `llmserve run-batch` (batch.py): its lines are sent to the app in
the process, at most half --max-num-seqs at a time (the rest stays for interactive requests) and at priority
BATCH_PRIORITY (behind interactive requests under --scheduling-policy priority). Each result is appended to
the partial file as it comes; at the end the successful ones (2xx) go to the output file, the others to the
error file (purpose "batch_output"), in the input's order. After a restart, a batch that was validating,
in progress or finalizing is resumed: the lines already in its partial file are not sent again. A batch
being cancelled starts no further line; those running finish, and what was done is in its files. A server
that stops (SIGTERM) starts no further line either, and leaves the batch in progress for the next start.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import time
import uuid

from llmserve.server.batch import (
    BATCH_PRIORITY,
    ENDPOINTS,
    check_lines,
    in_process_client,
    parse_lines,
    read_partial,
    record_partial,
    run_lines,
    succeeded,
)
from llmserve.server.errors import APIError

log = logging.getLogger("llmserve.batches")

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
PURPOSES = ("batch",)  # what clients may upload; the server writes "batch_output"


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_objects(folder: str) -> dict[str, dict]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    obj = json.load(f)
                out[obj["id"]] = obj
            except (OSError, ValueError, KeyError) as e:
                log.warning("skipping %s: %s", name, e)
    return out


def _page(objs: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list page: `objs` newest first, those after the one with id `after`, `limit` of them."""
    if after is not None:
        ids = [o["id"] for o in objs]
        objs = objs[ids.index(after) + 1 :] if after in ids else []
    data = objs[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(objs) > limit,
    }


def _newest_first(objs) -> list[dict]:
    """By creation: `created_at` is in seconds (OpenAI's); "created_ns" (kept on disk, not answered) breaks ties."""
    return sorted(objs, key=lambda o: (o["created_at"], o.get("created_ns", 0)), reverse=True)


class BatchStore:
    def __init__(self, root: str, max_file_bytes: int, concurrency: int) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_file_bytes = max_file_bytes
        self.concurrency = max(1, concurrency)
        self.files_dir = os.path.join(self.root, "files")
        self.batches_dir = os.path.join(self.root, "batches")
        os.makedirs(self.files_dir, exist_ok=True)
        os.makedirs(self.batches_dir, exist_ok=True)
        self._lock = open(os.path.join(self.root, ".lock"), "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise ValueError(f"--batch-dir: {self.root} is in use by another server (give each its own)") from None
        self.files = _read_objects(self.files_dir)
        self.batches = _read_objects(self.batches_dir)
        self.tasks: dict[str, asyncio.Task] = {}

    # -- files ---------------------------------------------------------------------------------
    def _content_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{file_id}.jsonl")

    def _save_file(self, obj: dict, data: bytes) -> dict:
        with open(self._content_path(obj["id"]), "wb") as f:
            f.write(data)
        _write_json(os.path.join(self.files_dir, f"{obj['id']}.json"), obj)
        self.files[obj["id"]] = obj
        return obj

    def add_file(self, filename: str, purpose: str, data: bytes) -> dict:
        """A client's upload: size and purpose checked, and a batch file's lines (400 naming the first bad ones)."""
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose: must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose")
        if len(data) > self.max_file_bytes:
            raise APIError(
                413,
                f"file: {len(data)} bytes is more than the limit of {self.max_file_bytes} (--max-batch-file-bytes)",
                param="file",
                code="file_too_large",
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise APIError(400, "file: must be UTF-8 text (JSONL)", param="file", code="invalid_file") from None
        errors = check_lines(parse_lines(text))
        if errors:
            msg = "file: not a valid batch file: " + "; ".join(e["message"] for e in errors)
            raise APIError(400, msg, param="file", code="invalid_file")
        return self._save_file(self._file_object(filename, purpose, len(data)), data)

    @staticmethod
    def _file_object(filename: str, purpose: str, size: int) -> dict:
        return {
            "id": f"file-{uuid.uuid4().hex[:24]}",
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "created_ns": time.time_ns(),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }

    def file(self, file_id: str) -> dict:
        obj = self.files.get(file_id)
        if obj is None:
            raise APIError(404, f"no file with id {file_id!r}", param="file_id", code="not_found")
        return obj

    def content(self, file_id: str) -> bytes:
        self.file(file_id)
        with open(self._content_path(file_id), "rb") as f:
            return f.read()

    def list_files(self, purpose: str | None, after: str | None, limit: int, order: str) -> dict:
        objs = [o for o in self.files.values() if purpose is None or o["purpose"] == purpose]
        objs = _newest_first(objs)
        return _page(objs if order == "desc" else objs[::-1], after, limit)

    def delete_file(self, file_id: str) -> dict:
        self.file(file_id)
        for path in (os.path.join(self.files_dir, f"{file_id}.json"), self._content_path(file_id)):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        del self.files[file_id]
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches -------------------------------------------------------------------------------
    def _save_batch(self, b: dict) -> None:
        _write_json(os.path.join(self.batches_dir, f"{b['id']}.json"), b)

    def _partial_path(self, batch_id: str) -> str:
        return os.path.join(self.batches_dir, f"{batch_id}.partial.jsonl")

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None) -> dict:
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
        if completion_window != "24h":
            msg = f"completion_window: must be '24h', got {completion_window!r}"
            raise APIError(400, msg, param="completion_window")
        f = self.file(input_file_id)
        if f["purpose"] != "batch":
            raise APIError(400, f"input_file_id: {input_file_id!r} is not a batch file", param="input_file_id")
        lines = parse_lines(self.content(input_file_id).decode("utf-8"), endpoint)
        errors = check_lines(lines)
        if errors:
            msg = f"input_file_id: {input_file_id!r} does not fit this batch: "
            msg += "; ".join(e["message"] for e in errors)
            raise APIError(400, msg, param="input_file_id", code="invalid_file")
        now = int(time.time())
        b = {
            "id": f"batch_{uuid.uuid4().hex}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "created_ns": time.time_ns(),
            "in_progress_at": None,
            "expires_at": now + 24 * 3600,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": len(lines), "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        self.batches[b["id"]] = b
        self._save_batch(b)
        return b

    def batch(self, batch_id: str) -> dict:
        b = self.batches.get(batch_id)
        if b is None:
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id", code="not_found")
        return b

    def list_batches(self, after: str | None, limit: int) -> dict:
        return _page(_newest_first(self.batches.values()), after, limit)

    def cancel(self, batch_id: str) -> dict:
        b = self.batch(batch_id)
        if b["status"] in ("cancelling", "cancelled"):
            return b
        if b["status"] not in ("validating", "in_progress"):
            raise APIError(409, f"batch {batch_id!r} is {b['status']}: it cannot be cancelled", code="conflict")
        b["status"], b["cancelling_at"] = "cancelling", int(time.time())
        self._save_batch(b)
        return b

    # -- running -------------------------------------------------------------------------------
    def start(self, app) -> None:
        """Run (or resume) every unfinished batch in the background of `app`'s event loop."""
        for b in _newest_first(self.batches.values())[::-1]:
            if b["status"] in UNFINISHED:
                self.launch(app, b["id"])

    def launch(self, app, batch_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._run(app, batch_id), name=f"llmserve-{batch_id}")
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _t: self.tasks.pop(batch_id, None))

    async def stop(self) -> None:
        """Stop the running batches where they are (shutdown): resumed at the next start."""
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lock.close()

    async def _run(self, app, batch_id: str) -> None:
        b = self.batches[batch_id]
        state = app.state.llm
        try:
            while not state.ready and b["status"] != "cancelling":  # the model loads
                if state.load_error is not None:
                    raise RuntimeError(f"the model failed to load: {state.load_error}")
                await asyncio.sleep(0.2)
            if b["status"] == "validating":
                b["status"], b["in_progress_at"] = "in_progress", int(time.time())
                self._save_batch(b)
            if b["input_file_id"] not in self.files:
                raise RuntimeError(f"the input file {b['input_file_id']} was deleted")
            lines = parse_lines(self.content(b["input_file_id"]).decode("utf-8"), b["endpoint"])
            done = read_partial(self._partial_path(batch_id))
            self._count(b, done)
            todo = [line for line in lines if line.index not in done]
            if b["status"] == "in_progress" and todo:
                await self._send(app, b, todo, done)
            if state.draining:  # the server stops: what is left runs at the next start
                self._save_batch(b)
                return
            await asyncio.to_thread(self._finish, b, lines, done)
        except asyncio.CancelledError:
            raise  # shutdown: the batch stays as it is, resumed at the next start
        except Exception as e:  # noqa: BLE001 - the batch fails, the server carries on
            log.exception("batch %s failed", batch_id)
            b["status"], b["failed_at"] = "failed", int(time.time())
            b["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": str(e), "line": None}]}
            self._save_batch(b)

    async def _send(self, app, b: dict, todo, done: dict[int, dict]) -> None:
        state = app.state.llm
        last_save = [time.monotonic()]
        with open(self._partial_path(b["id"]), "a", encoding="utf-8") as partial:

            def record(line, result) -> None:
                if state.draining and (result.get("response") or {}).get("status_code") == 503:
                    return  # refused because the server stops: not an answer, sent again at the next start
                record_partial(partial, line, result)
                done[line.index] = result
                b["request_counts"]["completed" if succeeded(result) else "failed"] += 1
                if time.monotonic() - last_save[0] > 1.0:  # the counts, for GET /v1/batches/{id} after a restart
                    last_save[0] = time.monotonic()
                    self._save_batch(b)

            async with in_process_client(app, state.api_keys) as client:
                await run_lines(
                    client,
                    todo,
                    self.concurrency,
                    record,
                    BATCH_PRIORITY,
                    stop=lambda: b["status"] == "cancelling" or state.draining,
                )

    @staticmethod
    def _count(b: dict, done: dict[int, dict]) -> None:
        ok = sum(succeeded(r) for r in done.values())
        b["request_counts"].update(completed=ok, failed=len(done) - ok)

    def _finish(self, b: dict, lines, done: dict[int, dict]) -> None:
        """The output and error files of what was done, in the input's order; the batch completed (or cancelled)."""
        cancelled = b["status"] == "cancelling"
        if not cancelled:
            b["status"], b["finalizing_at"] = "finalizing", int(time.time())
            self._save_batch(b)
        results = [done[line.index] for line in lines if line.index in done]
        for key, name, keep in (("output_file_id", "output", True), ("error_file_id", "errors", False)):
            chosen = [r for r in results if succeeded(r) == keep]
            if chosen and b[key] is None:
                data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen).encode("utf-8")
                obj = self._file_object(f"{b['id']}_{name}.jsonl", "batch_output", len(data))
                b[key] = self._save_file(obj, data)["id"]
        self._count(b, done)
        now = int(time.time())
        if cancelled:
            b["status"], b["cancelled_at"] = "cancelled", now
        else:
            b["status"], b["completed_at"] = "completed", now
        self._save_batch(b)
        try:
            os.remove(self._partial_path(b["id"]))
        except FileNotFoundError:
            pass
