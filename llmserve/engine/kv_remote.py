"""The shared tier of the prefix cache: a Redis-protocol store every replica reaches (`--kv-cache-url`).

Below RAM and `--kv-cache-dir`, modelled on the disk tier (kv_disk.py) with the same interface (`load`,
`save`, `stats`, `close`). A full block is keyed by the model's fingerprint and the block's chained name
(`llmserve:kv:<fingerprint>:<name>`); its value is a header (magic, fingerprint, name, payload size, CRC-32
of the payload) and the payload, so that an entry of another model, a torn or a tampered one is
recomputed, never trusted (and deleted). Blocks are copied out of the pool as steps complete them and a
writer thread sends them (one pipelined EXISTS, then one pipelined SET of the missing ones per batch); a
prompt whose blocks miss in RAM (and on disk) reads the following ones in pipelined runs, unless the run is
too short to pay for the round trip (`BreakEven`: docs/distributed.md). The store evicts by its own
`maxmemory` + LRU policy; a full store that refuses writes (`noeviction`) is logged once and read on.

A slow or absent store never fails a request: each call has a timeout (`--kv-cache-url-timeout`), failures
open a circuit breaker (llmserve/breaker.py) and the request computes as if there were no store; the writer
thread retries the store (PING) later and closes the breaker when it answers.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import struct
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from llmserve.breaker import CircuitBreaker
from llmserve.engine.kv_disk import (
    block_name,
    completed_blocks,
    install_blocks,
    model_fingerprint,
    request_digests,
)
from llmserve.engine.kv_store_client import connect, refusal, store_errors, unreachable
from llmserve.store_url import client_url, redacted

log = logging.getLogger("llmserve.kv_remote")

# an entry's header: magic, fingerprint, block name, payload bytes, CRC-32 of the payload. A checksum, not a
# signature: whoever may write to the store could forge either; it catches torn and corrupted entries, the
# fingerprint another model's (a CRC-32 reads the 92 MB of a 2,000-token prompt 2.5x faster than SHA-256 here)
MAGIC = b"LLMSKV02"
ENTRY = struct.Struct("<8s32s16sQI")
MAX_PENDING_BYTES = 256 << 20  # blocks copied out and not sent yet; more are dropped (counted)
READ_RUN_BYTES = 8 << 20  # one pipelined read asks for at most this much (the next is read meanwhile)
WRITE_BATCH_BYTES = 16 << 20
KNOWN_NAMES = 1 << 17  # names this process wrote or read lately (not copied out again)
FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def block_key(fingerprint: bytes, name: bytes) -> bytes:
    return b"llmserve:kv:" + fingerprint.hex()[:32].encode() + b":" + name.hex().encode()


def pack_block(fingerprint: bytes, name: bytes, payload) -> bytearray:
    """A store entry: a header (magic, fingerprint, name, payload size, CRC-32 of the payload), the payload (a
    tensor or a buffer). One copy, into the entry, by torch for a tensor (the GIL released: the engine's thread
    runs meanwhile); the checksum too runs without the GIL."""
    if isinstance(payload, torch.Tensor):
        nbytes = payload.numel() * payload.element_size()
        entry = bytearray(ENTRY.size + nbytes)
        torch.frombuffer(entry, dtype=payload.dtype, offset=ENTRY.size).view(payload.shape).copy_(payload)
    else:
        view = memoryview(payload).cast("B")
        nbytes = view.nbytes
        entry = bytearray(ENTRY.size + nbytes)
        entry[ENTRY.size :] = view
    ENTRY.pack_into(entry, 0, MAGIC, fingerprint, name, nbytes, zlib.crc32(memoryview(entry)[ENTRY.size :]))
    return entry


def unpack_block(value: bytes | None, fingerprint: bytes, name: bytes, nbytes: int) -> memoryview | None:
    """The payload (a view of `value`) of an entry that checks out: this model's, this block's, whole, its
    checksum right."""
    if value is None or len(value) != ENTRY.size + nbytes:
        return None
    magic, fp, key, n, checksum = ENTRY.unpack_from(value)
    if magic != MAGIC or fp != fingerprint or key != name or n != nbytes:
        return None
    payload = memoryview(value)[ENTRY.size :]
    return payload if zlib.crc32(payload) == checksum else None


class BreakEven:
    """Whether a run of blocks is worth fetching: a fetch costs a round trip plus its bytes over the measured
    fetch rate (network, checksum and copy into the pool); a recompute costs the block's tokens times the
    measured prefill time per token. The shortest run that pays is rtt / (recompute - transfer) per block;
    none pays where transfer >= recompute. Until both are measured every run is fetched."""

    def __init__(self, block_size: int, block_bytes: int, alpha: float = 0.2) -> None:
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.alpha = alpha
        self.rtt: float | None = None  # seconds of a call that moves no block
        self.seconds_per_byte: float | None = None  # beyond the round trip
        self.seconds_per_token: float | None = None  # prefill, measured on steps

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def round_trip(self, seconds: float) -> None:
        self.rtt = self._ewma(self.rtt, seconds)

    def fetched(self, seconds: float, nbytes: int) -> None:
        if nbytes > 0:
            self.seconds_per_byte = self._ewma(self.seconds_per_byte, max(seconds - (self.rtt or 0.0), 0.0) / nbytes)

    def step(self, seconds: float, tokens: int) -> None:
        if tokens >= 4 * self.block_size:  # a step that prefilled: its time is mostly per token
            self.seconds_per_token = self._ewma(self.seconds_per_token, seconds / tokens)

    def min_blocks(self) -> int | None:
        """The shortest run worth fetching (1 where nothing is measured yet); None: no run pays."""
        if self.rtt is None or self.seconds_per_byte is None or self.seconds_per_token is None:
            return 1
        gain = self.block_size * self.seconds_per_token - self.block_bytes * self.seconds_per_byte
        if gain <= 0:
            return None
        return max(1, math.ceil(self.rtt / gain))


class RemoteTier:
    def __init__(
        self,
        client,
        url: str,
        fingerprint: bytes,
        kv_caches: list[torch.Tensor],
        block_size: int,
        step_started=None,
    ) -> None:
        self.errors_caught = store_errors()  # what a failed call raises (one server's errors, a cluster's)
        self.client = client
        self.url = redacted(url)
        self.fingerprint = fingerprint
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.block_shape = (len(kv_caches),) + tuple(kv_caches[0][:, 0].shape)
        self.block_bytes = kv_caches[0][:, 0].numel() * kv_caches[0].element_size() * len(kv_caches)
        self.step_started = step_started  # when the engine's current step began (prefill time per token)
        self.breaker = CircuitBreaker(f"kv store {self.url}", log)
        self.break_even = BreakEven(block_size, self.block_bytes + ENTRY.size)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._saved: dict[str, int] = {}
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._full = False  # the store refuses writes (maxmemory with noeviction): logged once
        # counters (tokens, like vLLM's prefix-cache counters; bytes; calls)
        self.queries = self.hits = 0
        self.bytes_read = self.bytes_written = 0
        self.errors = self.corrupt_blocks = self.dropped_writes = self.refused_writes = self.skipped_fetches = 0
        self.fetch_buckets = [0] * (len(FETCH_BUCKETS) + 1)
        self.fetch_sum = 0.0
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-remote-reader")
        self._writer = threading.Thread(target=self._write_loop, name="kv-remote-writer", daemon=True)
        self._writer.start()

    # -- reading (the scheduler's thread) -------------------------------------------------------
    def _remember(self, name: bytes) -> None:
        with self._lock:
            self._known[name] = None
            self._known.move_to_end(name)
            while len(self._known) > KNOWN_NAMES:
                self._known.popitem(last=False)

    def _forget(self, names) -> None:
        with self._lock:
            for name in names:
                self._known.pop(name, None)

    def _observe(self, seconds: float) -> None:
        self.fetch_sum += seconds
        for i, bound in enumerate(FETCH_BUCKETS):
            if seconds <= bound:
                self.fetch_buckets[i] += 1
                return
        self.fetch_buckets[-1] += 1

    def load(self, kv, request, hits: list, max_blocks: int) -> list:
        """Blocks `len(hits)`.. of `request` found in the store, checked, copied into free blocks of `kv`'s pool
        and cached there (the caller takes them as hits). Any failure: fewer or no blocks, never an error."""
        start = len(hits)
        want = max_blocks - start
        if want <= 0:
            return []
        self.queries += want * self.block_size
        if not self.breaker.allow():
            return []
        pool = kv.pool
        pool.touch(hits)  # the hits found so far must not be evicted to make room
        try:
            n = min(want, pool.num_free)
            least = self.break_even.min_blocks()
            if n <= 0 or least is None or n < least:
                self.skipped_fetches += n > 0
                return []
            digests = request_digests(request, self.block_size, start + n)
            names = [block_name(request, d) for d in digests[start : start + n]]
            t0 = time.perf_counter()
            blocks: list = []
            with warnings.catch_warnings():  # read-only views of the values: copied into the pool, not written
                warnings.simplefilter("ignore", UserWarning)
                for payloads in self._runs(names):  # each run copied in while the next one is read
                    got = install_blocks(kv, request, start + len(blocks), payloads, self.kv_caches, self.block_shape)
                    blocks += got
            elapsed = time.perf_counter() - t0
            self._observe(elapsed)
            if not blocks:
                return []
            self.break_even.fetched(elapsed, len(blocks) * (self.block_bytes + ENTRY.size))
            for name in names[: len(blocks)]:
                self._remember(name)
            self.hits += len(blocks) * self.block_size
            return blocks
        finally:
            pool.free(hits)

    def _get(self, run: list[bytes]) -> list[tuple[bytes | None, memoryview | None]]:
        """(value, its payload if it checks out) for each of `run`'s names: read and checked by the reader thread."""
        pipe = self.client.pipeline(transaction=False)
        for name in run:
            pipe.get(block_key(self.fingerprint, name))
        values = pipe.execute()
        return [(v, unpack_block(v, self.fingerprint, n, self.block_bytes)) for n, v in zip(run, values)]

    def _runs(self, names: list[bytes]):
        """The payloads of the leading `names` present and sound, one list per pipelined run, up to the first
        missing or unsound entry or a failed call: the next run is read and checked (by a thread) while the
        caller copies this one into the pool."""
        per_run = max(1, READ_RUN_BYTES // (self.block_bytes + ENTRY.size))
        runs = [names[i : i + per_run] for i in range(0, len(names), per_run)]
        t0 = time.perf_counter()
        ahead = self._reader.submit(self._get, runs[0])
        for k, run in enumerate(runs):
            try:
                values = ahead.result()
            except self.errors_caught as e:
                self.errors += 1
                self._failed(e)
                return
            if k == 0:
                self.breaker.success()
                if values[0][0] is None:
                    self.break_even.round_trip(time.perf_counter() - t0)
            whole = all(p is not None for _, p in values)
            if whole and k + 1 < len(runs):
                ahead = self._reader.submit(self._get, runs[k + 1])
            out = []
            for name, (value, payload) in zip(run, values):
                if value is None:
                    break
                self.bytes_read += len(value)
                if payload is None:  # another model's, torn or tampered: recomputed, and deleted
                    self.corrupt_blocks += 1
                    self._forget([name])
                    log.warning("kv store: entry %s does not check out; its block is recomputed", name.hex())
                    self._queue.put(("delete", name))
                    whole = False
                    break
                out.append(payload)
            if out:
                yield out
            if not whole or len(out) < len(run):
                return

    # -- writing: the step copies blocks out, the writer thread sends them ----------------------
    def save(self, sched, kv) -> None:
        """After the model ran `sched`: copy the blocks it completed out of the pool for the writer."""
        if self.step_started is not None:
            tokens = sum(sched.num_scheduled_tokens.values())
            self.break_even.step(time.time() - self.step_started(), tokens)
        usable = self.breaker.allow()
        for name, block_id in completed_blocks(sched, kv, self._saved, self.block_size):
            if not usable or name in self._known:
                continue
            if self._pending + self.block_bytes > MAX_PENDING_BYTES:
                self.dropped_writes += 1
                continue
            data = torch.stack([c[:, block_id] for c in self.kv_caches]).cpu()
            self._remember(name)
            with self._lock:
                self._pending += self.block_bytes
            self._queue.put(("set", name, data))

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                self._probe()
                continue
            batch = [item]
            size = self.block_bytes
            while size < WRITE_BATCH_BYTES:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                size += self.block_bytes
            try:
                if any(i is None for i in batch):
                    return
                sets = [i for i in batch if i[0] == "set"]
                with self._lock:
                    self._pending -= len(sets) * self.block_bytes
                if self.breaker.allow():
                    self._write(sets, [i[1] for i in batch if i[0] == "delete"])
                else:
                    self.dropped_writes += len(sets)
                    self._forget(name for _, name, _ in sets)
                self._probe()
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, sets: list, deletes: list[bytes]) -> None:
        keys = [block_key(self.fingerprint, name) for _, name, _ in sets]
        try:
            if deletes:
                self.client.delete(*[block_key(self.fingerprint, n) for n in deletes])
            if not sets:
                return
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            present = pipe.execute()
            pipe = self.client.pipeline(transaction=False)
            sizes, sent = [], []
            for (_, name, data), k, there in zip(sets, keys, present):
                if not there:  # another replica may have sent it already
                    value = pack_block(self.fingerprint, name, data)
                    pipe.set(k, value)
                    sizes.append(len(value))
                    sent.append(name)
            results = pipe.execute(raise_on_error=False) if sizes else []
            down = [r for r in results if isinstance(r, Exception) and not refusal(r)]
            if down:  # a cluster's pipeline hands back a node's connection error or timeout as a result
                raise down[0]
        except self.errors_caught as e:
            self.errors += 1
            self.dropped_writes += len(sets)
            self._forget(name for _, name, _ in sets)
            self._failed(e)
            return
        self.breaker.success()
        refused = [r for r in results if isinstance(r, Exception)]
        self.bytes_written += sum(n for n, r in zip(sizes, results) if not isinstance(r, Exception))
        self.refused_writes += len(refused)
        self._forget(n for n, r in zip(sent, results) if isinstance(r, Exception))  # sent again if computed again
        if refused and not self._full:
            self._full = True
            log.warning(
                "kv store %s refuses writes (%s); reads go on (docs/distributed.md: maxmemory)", self.url, refused[0]
            )
        elif results and not refused and self._full:
            self._full = False
            log.warning("kv store %s takes writes again", self.url)

    def _failed(self, error: BaseException) -> None:
        """A refused connection, a wrong password or no node of a cluster answering opens the breaker at once;
        timeouts count to its threshold."""
        if unreachable(error):
            self.breaker.trip(error)
        else:
            self.breaker.failure(error)

    def _probe(self) -> None:
        """While the breaker is open: one PING once it is due (here, never on a request's path)."""
        if not self.breaker.probe_due():
            return
        try:
            t0 = time.perf_counter()
            self.client.ping()
            self.break_even.round_trip(time.perf_counter() - t0)
        except self.errors_caught as e:
            self._failed(e)
            return
        self.breaker.success()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until the blocks handed to the writer are sent (tests, shutdown)."""
        end = time.time() + timeout
        while self._queue.unfinished_tasks and time.time() < end:
            time.sleep(0.01)

    def close(self) -> None:
        self.flush(timeout=5.0)
        self._queue.put(None)
        self._writer.join(timeout=5)
        self._reader.shutdown(wait=False)
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass

    def stats(self) -> dict:
        least = self.break_even.min_blocks()
        return dict(
            external_prefix_cache_queries=self.queries,
            external_prefix_cache_hits=self.hits,
            kv_remote_queries=self.queries,
            kv_remote_hits=self.hits,
            kv_remote_misses=self.queries - self.hits,
            kv_remote_bytes_read=self.bytes_read,
            kv_remote_bytes_written=self.bytes_written,
            kv_remote_errors=self.errors,
            kv_remote_corrupt_blocks=self.corrupt_blocks,
            kv_remote_dropped_writes=self.dropped_writes,
            kv_remote_refused_writes=self.refused_writes,
            kv_remote_skipped_fetches=self.skipped_fetches,
            kv_remote_breaker_state=self.breaker.value,
            kv_remote_min_fetch_blocks=-1 if least is None else least,
            kv_remote_fetch_seconds=(FETCH_BUCKETS, list(self.fetch_buckets), self.fetch_sum),
        )


def _fingerprint_memo(disk_root: str | None) -> str | None:
    """Where model file digests are remembered (a restart does not read the weights again), if anywhere: beside
    the disk tier's files (`disk_root`), else in the user's cache."""
    memo = (
        os.path.join(disk_root, ".fingerprints")
        if disk_root
        else os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "fingerprints")
    )
    try:
        os.makedirs(memo, exist_ok=True)
        return memo
    except OSError:
        return None


def open_remote_tier(
    store, model_path: str, weights_dtype, kv_caches: list[torch.Tensor], step_started, disk_root: str | None = None
) -> RemoteTier:
    """The shared tier the plan's `store` settings (kv_plan.StorePlan) ask for over the runner's `kv_caches`;
    `step_started()`: when the engine's current step began. An unreachable store or a wrong password does not stop
    the start: the tier starts with its breaker open and retries."""
    url = client_url(store.url)
    password = None
    if store.password_file:
        with open(store.password_file) as f:
            password = f.read().strip()
    client = connect(url, password, store.timeout)
    settings = dict(store.settings, dtype=str(weights_dtype))
    fp = model_fingerprint(model_path, settings, _fingerprint_memo(disk_root))
    tier = RemoteTier(client, url, fp, kv_caches, settings["block_size"], step_started=step_started)
    try:
        t0 = time.perf_counter()
        client.ping()
        tier.break_even.round_trip(time.perf_counter() - t0)
        log.info("kv store: %s (model %s, blocks of %d bytes)", tier.url, fp.hex()[:12], tier.block_bytes)
    except tier.errors_caught as e:
        tier.errors += 1
        tier.breaker.trip(e)
    return tier
