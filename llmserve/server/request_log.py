"""`llmserve serve --log-requests FILE`: every generating request's prompt, max_tokens and arrival time appended to a
JSONL file, the request log `llmserve tune --workload FILE` replays with its timing (llmserve/tune/workload.py).

One line per engine request (a request with n choices or several prompts writes one per run): `prompt` (the prompt
as the engine saw it, chat template applied, special tokens kept: a replay through /v1/completions sends the
same tokens), `max_tokens`, `arrival` (seconds since the server started), `model`. Lines are written whole and
flushed as they come, so a log read while the server runs is never cut inside a line."""

from __future__ import annotations

import json
import threading
import time


class RequestLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self.t0 = time.time()
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # (the server's own file: open for its lifetime)

    def write(self, tokenizer, model: str, ids: list[int], max_tokens: int | None, arrival: float) -> None:
        line = {
            "prompt": tokenizer.decode(ids, skip_special_tokens=False),
            "max_tokens": max_tokens or 16,
            "arrival": round(max(arrival - self.t0, 0.0), 4),
            "model": model,
        }
        text = json.dumps(line, ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
