"""The disk tier of the prefix cache (`--kv-cache-dir`, `--kv-cache-dir-size`).

Full blocks are written as steps compute them: the step copies the block out of the pool (a memcpy) and a
writer thread does the checksum and the file; nothing else is on the step's path. A prompt whose leading
blocks miss in RAM looks for the following ones on disk (`load`, called by `KVCacheManager`): each file
found whole is copied into a free block of the pool and named by its hash there, so the scheduler sees an
ordinary prefix-cache hit.

Files live in `<dir>/<fingerprint>/<xx>/<name>.kv`: the fingerprint covers the model's files (a content
hash), the weights' dtype, the quantization, the KV dtype, the block size and the shapes; the name is the
block's chained name (`kv_events.chain_digests`: tokens, parent, cache salt, adapter name) and, under an
adapter, its folder. A file is a header (magic, fingerprint, name, payload size, SHA-256 of the payload)
and the payload; it is written to a temporary file and renamed into place, so several replicas can share
one folder. A file whose header or checksum does not match is deleted and its block recomputed. The
folder is kept under `--kv-cache-dir-size` GiB by deleting the least recently used files (a hit refreshes
a file's time). A folder that cannot be written turns the tier off with one warning; serving goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time

import torch

from llmserve.engine.kv_events import request_digests

log = logging.getLogger("llmserve.kv_disk")

MAGIC = b"LLMSKV01"
HEADER = struct.Struct("<8s32s16sQ32s")  # magic, fingerprint, block name, payload bytes, SHA-256 of payload
MAX_PENDING_BYTES = 512 << 20  # blocks copied out and not written yet; more are dropped (counted)


def _file_digest(path: str, cache_dir: str | None) -> str:
    """SHA-256 of a model file, remembered in `cache_dir` by (path, size, mtime) so that a restart does not
    read the weights twice."""
    st = os.stat(path)
    tag = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = os.path.join(cache_dir, tag) if cache_dir else None
    if memo and os.path.exists(memo):
        with open(memo) as f:
            return f.read().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    if memo:
        try:
            _atomic_write(memo, digest.encode())
        except OSError:
            pass
    return digest


def model_fingerprint(model_path: str, settings: dict, cache_dir: str | None = None) -> bytes:
    """What a block's KV depends on besides its tokens: the model's files (contents) and the settings that
    change the numbers (dtype, quantization, KV dtype, block size, shapes)."""
    if os.path.isfile(model_path):
        files = [model_path]
    else:
        files = sorted(
            os.path.join(d, n)
            for d, _, names in os.walk(model_path)
            for n in names
            if n.endswith((".safetensors", ".bin", ".gguf", ".pt", ".json"))
        )
    h = hashlib.sha256()
    for f in files:
        h.update(f"{os.path.relpath(f, model_path) if f != model_path else ''}:{_file_digest(f, cache_dir)}\n".encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.digest()


def _atomic_write(path: str, *parts) -> int:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    n = 0
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                n += f.write(p)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return n


def block_name(request, digest: bytes) -> bytes:
    """A block's name outside the process: its chained digest, and under an adapter its folder too."""
    if request.lora is None:
        return digest
    return hashlib.blake2b(digest + str(request.lora.path).encode(), digest_size=len(digest)).digest()


def completed_blocks(sched, kv, saved: dict[str, int], block_size: int):
    """(name, block id) of each full block the step `sched` completed (prompt hits included) that `saved`
    (request id -> blocks seen, updated) has not seen: what a tier below RAM may store."""
    for r in sched.requests:
        done = min(r.num_computed_tokens + sched.num_scheduled_tokens[r.request_id], r.num_tokens) // block_size
        start = saved.get(r.request_id, 0)
        if done <= start:
            continue
        saved[r.request_id] = done
        blocks = kv.req_blocks.get(r.request_id, [])
        digests = request_digests(r, block_size, done)
        for i in range(start, min(done, len(blocks))):
            yield block_name(r, digests[i]), blocks[i].block_id
    if len(saved) > 4 * max(len(kv.req_blocks), 16):  # forget finished requests
        for k in [k for k in saved if k not in kv.req_blocks]:
            del saved[k]


def install_blocks(kv, request, start: int, payloads: list, kv_caches: list[torch.Tensor], block_shape) -> list:
    """Copy checked payloads (a block's KV of every layer) into free blocks of `kv`'s pool as blocks `start`..
    of `request`, cached and free like any block no request holds: the caller takes them as hits."""
    pool = kv.pool
    blocks = pool.allocate(len(payloads))
    for j, (block, buf) in enumerate(zip(blocks, payloads)):
        data = torch.frombuffer(buf, dtype=kv_caches[0].dtype).view(block_shape)
        for layer, cache in enumerate(kv_caches):
            cache[:, block.block_id].copy_(data[layer])
        kv.cache_block(request, start + j, block, request.block_hashes[start + j])
    pool.free(reversed(blocks))
    return blocks


class DiskTier:
    def __init__(self, root: str, max_bytes: int, fingerprint: bytes, kv_caches: list[torch.Tensor], block_size: int):
        self.root = root
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.dir = os.path.join(root, fingerprint.hex()[:32])
        self.kv_caches = kv_caches
        self.block_size = block_size
        shape = (len(kv_caches),) + tuple(kv_caches[0][:, 0].shape)  # [layers, 2, block, heads, head_dim]
        self.block_shape = shape
        self.dtype = kv_caches[0].dtype
        self.block_bytes = kv_caches[0][:, 0].numel() * kv_caches[0].element_size() * len(kv_caches)
        self.enabled = True
        self._warned = False
        self._on_disk: set[bytes] = set()  # names this process wrote or read (no need to write them again)
        self._saved: dict[str, int] = {}  # request id -> blocks handed to the writer
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._total = None  # bytes in the folder, counted by the writer thread
        # counters, read by EngineStats (vLLM's external_prefix_cache_* count tokens)
        self.queries = 0  # prompt tokens looked up on disk (after a miss in RAM)
        self.hits = 0  # ... and found
        self.bytes_read = 0
        self.bytes_written = 0
        self.load_seconds = 0.0
        self.corrupt_files = 0
        self.dropped_writes = 0
        self.copy_seconds = 0.0  # on the step's path: copying completed blocks out of the pool
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # -- reading (the scheduler's thread) -------------------------------------------------------
    def _path(self, name: bytes) -> str:
        h = name.hex()
        return os.path.join(self.dir, h[:2], h + ".kv")

    def _read(self, name: bytes) -> bytearray | None:
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                if len(head) == HEADER.size:
                    magic, fp, key, n, checksum = HEADER.unpack(head)
                    if magic == MAGIC and fp == self.fingerprint and key == name and n == self.block_bytes:
                        buf = bytearray(n)
                        if f.readinto(buf) == n and not f.read(1) and hashlib.sha256(buf).digest() == checksum:
                            self.bytes_read += HEADER.size + n
                            try:
                                os.utime(path)  # recently used: the last to be evicted
                            except OSError:
                                pass
                            return buf
        except FileNotFoundError:
            return None
        except OSError as e:
            log.debug("kv disk: cannot read %s: %r", path, e)
            return None
        # torn, truncated, tampered or another model's: never trusted; recomputed (and written again)
        self.corrupt_files += 1
        self._on_disk.discard(name)
        log.warning("kv disk: %s does not check out; its block is recomputed", path)
        try:
            os.remove(path)
        except OSError:
            pass
        return None

    def load(self, kv, request, hits: list, max_blocks: int) -> list:
        """Blocks `len(hits)`.. of `request` that are on disk, copied into free blocks of `kv`'s pool and cached
        there (free, named by their hash: the caller takes them as hits)."""
        if not self.enabled:
            return []
        t0 = time.perf_counter()
        start = len(hits)
        self.queries += (max_blocks - start) * self.block_size
        pool = kv.pool
        pool.touch(hits)  # the hits found in RAM must not be evicted to make room
        try:
            room = pool.num_free
            digests = request_digests(request, self.block_size, max_blocks)
            found: list[tuple[bytes, bytearray]] = []
            for i in range(start, min(max_blocks, start + room)):
                name = block_name(request, digests[i])
                buf = self._read(name)
                if buf is None:
                    break
                found.append((name, buf))
            if not found:
                return []
            blocks = install_blocks(kv, request, start, [buf for _, buf in found], self.kv_caches, self.block_shape)
            self._on_disk.update(name for name, _ in found)
            self.hits += len(blocks) * self.block_size
            return blocks
        finally:
            pool.free(hits)
            self.load_seconds += time.perf_counter() - t0

    # -- writing: the step copies blocks out, the writer thread writes them ---------------------
    def save(self, sched, kv) -> None:
        """After the model ran `sched`: copy the blocks it completed out of the pool for the writer."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        for name, block_id in completed_blocks(sched, kv, self._saved, self.block_size):
            if name in self._on_disk:
                continue
            if self._pending + self.block_bytes > MAX_PENDING_BYTES:
                self.dropped_writes += 1
                continue
            data = torch.stack([c[:, block_id] for c in self.kv_caches]).cpu()
            self._on_disk.add(name)
            with self._lock:
                self._pending += self.block_bytes
            self._queue.put((name, data))
        self.copy_seconds += time.perf_counter() - t0

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                name, data = item
                with self._lock:
                    self._pending -= self.block_bytes
                if self.enabled:
                    self._write(name, data)
            finally:
                self._queue.task_done()

    def _write(self, name: bytes, data: torch.Tensor) -> None:
        path = self._path(name)
        payload = data.contiguous().view(torch.uint8).numpy()
        try:
            if self._total is None:
                self._total = self._folder_bytes()
            if os.path.exists(path):  # another replica wrote it
                return
            os.makedirs(os.path.dirname(path), exist_ok=True)
            head = HEADER.pack(MAGIC, self.fingerprint, name, payload.nbytes, hashlib.sha256(payload).digest())
            n = _atomic_write(path, head, memoryview(payload).cast("B"))
        except OSError as e:
            self.disable(f"cannot write {path}: {e}")
            return
        self.bytes_written += n
        self._total += n
        if self._total > self.max_bytes:
            self._evict()

    def _files(self) -> list[tuple[float, int, str]]:
        out = []
        for d, _, names in os.walk(self.root):
            for n in names:
                if n.endswith(".kv"):
                    p = os.path.join(d, n)
                    try:
                        st = os.stat(p)
                    except OSError:
                        continue
                    out.append((st.st_mtime, st.st_size, p))
        return out

    def _folder_bytes(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _evict(self) -> None:
        """Delete the least recently used files (of every model in the folder) down to 90% of the limit."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total <= 0.9 * self.max_bytes:
                break
            try:
                os.remove(p)
            except OSError:
                continue
            total -= size
            name = bytes.fromhex(os.path.basename(p).removesuffix(".kv"))
            self._on_disk.discard(name)
        self._total = total

    def disable(self, why: str) -> None:
        """Serving goes on without the tier (one warning)."""
        self.enabled = False
        if not self._warned:
            self._warned = True
            log.warning("kv disk: %s; the disk tier is off, serving goes on without it", why)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until the blocks handed to the writer are written (tests, shutdown)."""
        end = time.time() + timeout
        while self._queue.unfinished_tasks and time.time() < end:
            time.sleep(0.01)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)

    def stats(self) -> dict:
        return dict(
            external_prefix_cache_queries=self.queries,
            external_prefix_cache_hits=self.hits,
            kv_disk_bytes_read=self.bytes_read,
            kv_disk_bytes_written=self.bytes_written,
            kv_disk_load_seconds=self.load_seconds,
            kv_disk_corrupt_files=self.corrupt_files,
            kv_disk_dropped_writes=self.dropped_writes,
        )


def open_disk_tier(disk, model_path: str, weights_dtype, kv_caches: list[torch.Tensor]) -> DiskTier | None:
    """The disk tier the plan's `disk` settings (kv_plan.DiskPlan) ask for over the runner's `kv_caches`, or None
    (with one warning) where the folder cannot be written."""
    root = disk.root
    settings = dict(disk.settings, dtype=str(weights_dtype))
    try:
        os.makedirs(os.path.join(root, ".fingerprints"), exist_ok=True)
        fp = model_fingerprint(model_path, settings, os.path.join(root, ".fingerprints"))
        tier = os.path.join(root, fp.hex()[:32])
        os.makedirs(tier, exist_ok=True)
        _atomic_write(os.path.join(tier, ".probe"), b"ok")
        os.remove(os.path.join(tier, ".probe"))
    except OSError as e:
        log.warning("kv disk: cannot use %s (%s); serving goes on without the disk tier", root, e)
        return None
    log.info("kv disk: %s (model %s, up to %.1f GiB)", root, fp.hex()[:12], disk.size_gib)
    return DiskTier(root, disk.max_bytes, fp, kv_caches, settings["block_size"])
