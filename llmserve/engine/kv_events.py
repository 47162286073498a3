"""Stable names of KV blocks, and the engine's block stored / removed events.

The prefix cache keys a full block by a chained tuple (parent, tokens, extras) hashed with Python's
`hash`, which is salted per process for strings. What leaves the process (files of the disk tier, events
read by a router) needs a name that every process computes alike: `chain_digests` chains the same inputs
(the parent block's name, the block's token ids, the cache salt, the LoRA adapter's name) through
BLAKE2b. A router that knows a request's token ids computes the same names (`llmserve.router` imports this
module; it has no torch).

`KVEventLog` is what `--kv-events-config` turns on (as vLLM's): the pool reports each block it names by
hash ("BlockStored") and each one it evicts or forgets ("BlockRemoved"); readers pull the events after a
sequence number (`since`), or, when they are too far behind, a snapshot of every cached block.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from array import array
from collections import deque

DIGEST_SIZE = 16  # bytes of a block's name (BLAKE2b-128)
HASH_ALGO = "blake2b-128 chain"  # named in the events, so a reader knows what it must compute


def chain_extra(cache_salt: str | None = None, lora_name: str | None = None) -> bytes:
    """The extras of a request's block names: its cache salt and the adapter it runs under."""
    extra = b""
    if cache_salt:
        extra += b"salt\0" + cache_salt.encode() + b"\0"
    if lora_name:
        extra += b"lora\0" + lora_name.encode() + b"\0"
    return extra


def chain_digests(
    tokens: list[int], block_size: int, extra: bytes = b"", known: list[bytes] | None = None, images=()
) -> list[bytes]:
    """The names of the full blocks of `tokens`: `known` (the names already computed, extended in place) plus
    those of the following full blocks. `images` (a vision request's: start, end, content_hash): a block holding
    an image's placeholders is named by the picture too, as the RAM prefix cache keys it (KVCacheManager)."""
    out = known if known is not None else []
    parent = out[-1] if out else b""
    for i in range(len(out), len(tokens) // block_size):
        h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
        h.update(array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes())
        h.update(extra)
        for im in images:
            if im.start < (i + 1) * block_size and im.end > i * block_size:
                h.update(b"image\0" + im.content_hash.encode() + b"\0")
        parent = h.digest()
        out.append(parent)
    return out


def request_digests(request, block_size: int, upto: int) -> list[bytes]:
    """The names of a request's first `upto` full blocks (cached on the request)."""
    if len(request.block_digests) < upto:
        lora = request.lora.name if request.lora is not None else None
        extra = chain_extra(request.cache_salt, lora)
        tokens = request.all_token_ids[: upto * block_size]
        chain_digests(tokens, block_size, extra, request.block_digests, request.images)
    return request.block_digests[:upto]


class KVEventLog:
    """Block stored / removed events with sequence numbers, kept up to `max_events`; thread-safe (the engine
    thread writes, the server's thread reads)."""

    def __init__(self, block_size: int, max_events: int = 10_000) -> None:
        self.block_size = block_size
        self.max_events = max_events
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, list[str]]] = deque()
        self._seq = 0
        self._by_block: dict[int, str] = {}  # block id -> the name it is cached under
        self.instance = uuid.uuid4().hex  # a reader that sees another instance (a restart) starts over

    # -- written by the KV cache manager (the engine's thread) --
    def stored(self, request, index: int, block) -> None:
        name = request_digests(request, self.block_size, index + 1)[index].hex()
        with self._lock:
            self._by_block[block.block_id] = name
            self._append("BlockStored", name)

    def removed(self, block) -> None:
        with self._lock:
            name = self._by_block.pop(block.block_id, None)
            if name is not None:
                self._append("BlockRemoved", name)

    def _append(self, kind: str, name: str) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last[1] == kind and last[0] == self._seq and len(last[2]) < 256:
            last[2].append(name)  # one event per run of the same kind (the reader sees the new sequence number)
            self._seq += 1
            self._events[-1] = (self._seq, kind, last[2])
            return
        self._seq += 1
        self._events.append((self._seq, kind, [name]))
        while len(self._events) > self.max_events:
            self._events.popleft()

    # -- read by the server --
    def since(self, after: int) -> dict:
        """The events after sequence number `after`; a snapshot (AllBlocksCleared, then every cached block as
        stored) when some of those events are gone or `after` is not from this log (another process)."""
        with self._lock:
            first = self._events[0][0] - len(self._events[0][2]) + 1 if self._events else self._seq + 1
            body = {"block_size": self.block_size, "hash": HASH_ALGO, "seq": self._seq, "instance": self.instance}
            if 0 <= after <= self._seq and after >= first - 1:
                body["reset"] = False
                body["events"] = [
                    {"seq": seq, "type": kind, "block_hashes": list(names)}
                    for seq, kind, names in self._events
                    if seq > after
                ]
            else:
                body["reset"] = True
                body["events"] = [
                    {"seq": self._seq, "type": "AllBlocksCleared", "block_hashes": []},
                    {"seq": self._seq, "type": "BlockStored", "block_hashes": sorted(self._by_block.values())},
                ]
            return body


def parse_kv_events_config(text: str | None) -> dict | None:
    """--kv-events-config's JSON (vLLM's flag): None when events are off. The publisher here is `http` (GET
    /kv_events on the server); `max_events` bounds the log."""
    if not text:
        return None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_events_config: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError("kv_events_config: must be a JSON object")
    unknown = set(cfg) - {"enable_kv_cache_events", "publisher", "max_events"}
    if unknown:
        raise ValueError(f"kv_events_config: unknown keys {sorted(unknown)}")
    if cfg.get("publisher", "http") != "http":
        raise ValueError("kv_events_config: publisher must be 'http' (GET /kv_events)")
    n = cfg.get("max_events", 10_000)
    if not isinstance(n, int) or n < 1:
        raise ValueError("kv_events_config: max_events must be a positive integer")
    return cfg if cfg.get("enable_kv_cache_events", False) else None


def open_event_log(text: str | None, block_size: int) -> KVEventLog | None:
    """The event log --kv-events-config asks for, or None."""
    cfg = parse_kv_events_config(text)
    return KVEventLog(block_size, cfg.get("max_events", 10_000)) if cfg is not None else None
