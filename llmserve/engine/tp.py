"""Tensor-parallel workers on torch.distributed: rank 0 is the engine, ranks 1..N-1 run the model.

    rank 0 (LLMEngine)                         rank r (worker)
    scheduler -> runner builds the batch (TensorParallel.execute)
    broadcast (ids, positions, metadata) ----> receive
    forward on its shard  <== all-reduce ==>   forward on its shard (own heads, own KV cache)
    sample from its logits                     (logits discarded)

The split itself (which heads, which MLP columns) is `llmserve.model.parallel`. Each rank loads the
checkpoint and keeps its slices; each holds the KV cache of its own heads; the block tables are rank
0's and travel with every step, so the workers keep no scheduler state at all.

Process groups: the default group (gloo on CPU, NCCL on CUDA) carries the all-reduces, with a finite
timeout (`LLMSERVE_TP_TIMEOUT`, default 120 s) so that a stuck peer fails the step rather than hanging
it; a second gloo group carries the step messages (pickled CPU tensors) and waits without limit, since
workers sit idle between requests. A worker that dies closes its sockets: the next broadcast or
all-reduce on rank 0 raises at once, `LLMEngine.step()` raises, and the server stops being ready and
exits non-zero. Rank 0 also checks the spawned workers' liveness before each step, for a clear message.

How the processes start:

* one machine (the default): rank 0 spawns ranks 1..N-1 (`torch.multiprocessing`, spawn) and they
  rendezvous at `tcp://127.0.0.1:<free port>` (or `--distributed-init-method`). They stop with the
  engine (`LLMEngine.shutdown()`, or when the engine process exits).
* several machines: every process is started from outside, with RANK and WORLD_SIZE in its
  environment, by `torchrun` (init method `env://`) or by hand with `--distributed-init-method
  tcp://HOST:PORT`. The process with RANK=0 serves HTTP; the others run `run_worker` (see
  `llmserve.server.cli`). docs/distributed.md has the commands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from llmserve import envs
from llmserve.engine.runner import ModelRunner
from llmserve.model.config import ModelConfig
from llmserve.model.kernels import ops
from llmserve.model.parallel import load_sharded_model, local_config, plan_heads

log = logging.getLogger("llmserve.tp")

FOREVER = datetime.timedelta(days=3650)


class TensorParallelError(RuntimeError):
    """A tensor-parallel peer failed; the engine cannot continue."""


def step_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=envs.LLMSERVE_TP_TIMEOUT)


def external_launch() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when the processes were started from outside (torchrun, or
    RANK/WORLD_SIZE set by hand); None when rank 0 spawns its own workers."""
    rank, world = envs.RANK, envs.WORLD_SIZE
    if rank is not None and world is not None:
        return rank, world, envs.LOCAL_RANK
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(config, local_rank: int) -> torch.device:
    dev = config.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init_groups(device: torch.device, init_method: str, rank: int, world: int):
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=step_timeout(), **kwargs
    )
    return dist.new_group(backend="gloo", timeout=FOREVER)  # step messages: waits while idle


def _to(obj, device: torch.device):
    """The step payload with every tensor (also inside the attention metadata) moved to `device`."""
    from llmserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, AttentionMetadata):
        return AttentionMetadata(
            slot_mapping=_to(obj.slot_mapping, device),
            decode_groups=[_to(g, device) for g in obj.decode_groups],
            prefills=[_to(p, device) for p in obj.prefills],
            window=_to(obj.window, device),
        )
    if isinstance(obj, DecodeGroup):
        return DecodeGroup(obj.start, obj.end, obj.block_tables.to(device), obj.context_lens.to(device))
    if isinstance(obj, PrefillChunk):
        return dataclasses.replace(obj, block_table=obj.block_table.to(device))  # (bidirectional runs kept)
    return obj


class _AllReduce:
    """The hook the model calls after each row-parallel layer: sum over the ranks (in place)."""

    def __init__(self, owner: "TensorParallel | None" = None) -> None:
        self.enabled = True
        self.owner = owner

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return t
        try:
            dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001 - a peer died or hung: the engine cannot go on
            who = self.owner.dead_workers() if self.owner is not None else ""
            raise TensorParallelError(f"tensor parallel: all-reduce failed{who}: {e}") from e
        return t


def _load_weights(config, path_hint: str | None = None):
    """(ModelSource, ModelConfig, HF weights), resolving and converting exactly as the engine does."""
    from llmserve.model.loader import load_gguf_weights, load_hf_weights, load_model_config, resolve_model

    source = resolve_model(path_hint or config.model)
    mc, reader = load_model_config(source)
    if reader is not None:  # float shards: the file dequantized in memory (no float32 copy on disk)
        return source, mc, load_gguf_weights(reader, mc, source.path)
    return source, mc, load_hf_weights(source.path)


def _max_positions(config, mc: ModelConfig) -> int:
    return (config.max_model_len or mc.max_position_embeddings) + max(config.num_lookahead_tokens, 0) + 1


class TensorParallel:
    """Rank 0's side: plans the split, starts (or joins) the workers, broadcasts every step."""

    def __init__(self, config, mc: ModelConfig) -> None:
        n = config.tensor_parallel_size
        self.world_size = n
        self.shards = plan_heads(mc, n)  # refuses an impossible split before anything starts
        self.mc = mc
        self.config = config
        self.procs: list = []
        self.closed = False
        self.runner = None  # rank 0's ModelRunner (start)
        ext = external_launch()
        if ext is not None:
            rank, world, local_rank = ext
            if rank != 0:
                raise TensorParallelError(f"tensor parallel: the engine runs on rank 0, this is rank {rank}")
            if world != n:
                raise ValueError(f"tensor_parallel_size: {n}, but WORLD_SIZE is {world}")
            init_method = config.distributed_init_method or "env://"
        else:
            local_rank = 0
            init_method = config.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        self.device = _device(config, local_rank)
        self.all_reduce = _AllReduce(self)
        if ext is None:
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            for r in range(1, n):
                p = ctx.Process(
                    target=_spawned_worker,
                    args=(config, r, n, init_method, os.getpid()),
                    name=f"llmserve-tp{r}",
                    daemon=True,
                )
                p.start()
                self.procs.append(p)
        log.info(
            "tensor parallel: %d ranks (%s), rendezvous %s; heads per rank %s, KV heads per rank %s",
            n,
            "spawned here" if ext is None else "started outside",
            init_method,
            [s.num_heads for s in self.shards],
            [s.num_kv_heads for s in self.shards],
        )
        try:
            self.ctrl = _init_groups(self.device, init_method, 0, n)
        except BaseException:
            self._kill()
            raise

    # -- start-up ------------------------------------------------------------------------------
    @property
    def local_config(self) -> ModelConfig:
        return local_config(self.mc, self.shards[0])

    @property
    def kv_heads(self) -> int:
        """Per rank: the largest share (ranks hold different numbers of KV heads when they split unevenly)."""
        return max(s.num_kv_heads for s in self.shards)

    def load_model(self, source, reader, dtype: torch.dtype, max_positions: int, kv_bytes: int = 0):
        """Rank 0's shard (its weights read from `source`'s files; each worker reads its own)."""
        weights = _load_weights(None, source.path)[2]
        model = load_sharded_model(weights, self.mc, self.shards[0], self.device, dtype, max_positions, self.all_reduce)
        return model

    @contextlib.contextmanager
    def local_only(self):
        """Run the rank-0 shard alone (CUDA activation profiling): no all-reduce."""
        self.all_reduce.enabled = False
        try:
            yield
        finally:
            self.all_reduce.enabled = True

    def start(self, model, plan, dtype: torch.dtype, kv_dtype: torch.dtype, lora=None):
        """Rank 0's runner; tell the workers the KV plan and wait until every rank has loaded its shard."""
        self.runner = ModelRunner(model, plan, self.device, dtype, kv_dtype, lora)
        self._send(("init", plan))
        done = torch.zeros(1)
        work = dist.all_reduce(done, group=self.ctrl, async_op=True)  # "loaded" barrier
        while not work.is_completed():
            self.check_workers()
            time.sleep(0.05)
        work.wait()
        log.info("tensor parallel: all %d ranks loaded", self.world_size)
        return self.runner

    def execute(self, sched, argmax: bool = False):
        """One step: its batch broadcast to the workers, then run on rank 0's shard (all-reducing with them)."""
        batch = self.runner.prepare(sched)  # (rank 0's copies on write made: the workers make theirs first)
        self.broadcast_step(batch.input_ids, batch.positions, batch.meta, batch.logits_rows, sched.block_copies)
        return self.runner.sample(batch, argmax)

    # -- every step ----------------------------------------------------------------------------
    def dead_workers(self) -> str:
        dead = [
            f"rank {i + 1} (pid {p.pid}) exited with {p.exitcode}" for i, p in enumerate(self.procs) if not p.is_alive()
        ]
        return f" ({'; '.join(dead)})" if dead else ""

    def check_workers(self) -> None:
        dead = self.dead_workers()
        if dead:
            raise TensorParallelError(f"tensor parallel: a worker died{dead}")

    def _send(self, msg) -> None:
        if self.closed:
            raise TensorParallelError("tensor parallel: the workers have been shut down")
        try:
            dist.broadcast_object_list([msg], src=0, group=self.ctrl)
        except Exception as e:  # noqa: BLE001
            raise TensorParallelError(f"tensor parallel: cannot reach the workers{self.dead_workers()}: {e}") from e

    def broadcast_step(self, input_ids, positions, meta, logits_indices, block_copies=()) -> None:
        """The step's batch (workers' logits are discarded: one row will do) and the block copies to make first."""
        self.check_workers()
        cpu = torch.device("cpu")
        self._send(
            ("step", _to(input_ids, cpu), _to(positions, cpu), _to(meta, cpu), _to(logits_indices[-1:], cpu))
            + (list(block_copies),)
        )

    # -- shutdown ------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        try:
            if not self.dead_workers():
                self._send(("stop",))
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        self.closed = True
        deadline = time.time() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.time()))
        self._kill()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


# -- the worker side ----------------------------------------------------------------------------
def _watch_parent(ppid: int) -> None:
    """A spawned worker exits when its engine process is gone (even after SIGKILL)."""

    def watch():
        while True:
            if os.getppid() != ppid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="llmserve-tp-parent", daemon=True).start()


def _spawned_worker(config, rank: int, world: int, init_method: str, ppid: int) -> None:
    _watch_parent(ppid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    try:
        run_worker(config, rank, world, rank, init_method)
    except TensorParallelError as e:
        log.error("%s", e)
        raise SystemExit(1) from None


def run_worker(config, rank: int, world: int, local_rank: int, init_method: str) -> int:
    """A worker rank: load its shard, then run every step rank 0 broadcasts until told to stop."""
    from llmserve.model.loader import activation_dtype, resolve_dtype, resolve_kv_dtype

    torch.set_num_threads(config.resolved_num_threads())
    ops.configure(config.kernels)
    device = _device(config, local_rank)
    dtype = resolve_dtype(config.dtype, device, plain=False)
    ctrl = _init_groups(device, init_method, rank, world)
    source, mc, weights = _load_weights(config)
    shard = plan_heads(mc, world)[rank]
    model = load_sharded_model(weights, mc, shard, device, dtype, _max_positions(config, mc), _AllReduce())
    del weights
    log.info(
        "rank %d/%d: %d heads %s, KV heads %s, MLP columns %s on %s",
        rank,
        world,
        shard.num_heads,
        list(shard.q_heads),
        list(shard.kv_heads),
        shard.mlp_cols,
        device,
    )

    def recv():
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=ctrl)
        except Exception as e:  # noqa: BLE001 - rank 0 is gone
            raise TensorParallelError(f"tensor parallel rank {rank}: lost rank 0: {e}") from e
        return box[0]

    msg = recv()
    if msg[0] == "stop":
        return 0
    _, plan = msg
    act = activation_dtype(dtype, device)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, act, device)
    runner = ModelRunner(model, plan, device, act, kv_dtype)
    dist.all_reduce(torch.zeros(1), group=ctrl)  # "loaded" barrier
    with torch.inference_mode():
        while True:
            msg = recv()
            if msg[0] == "stop":
                break
            _, ids, pos, meta, idx, copies = msg
            if copies:  # the copies on write of the step (KVCacheManager.get_computed_blocks), in this rank's KV
                runner.copy_blocks(copies)
            model(ids.to(device), pos.to(device), runner.kv_caches, _to(meta, device), idx.to(device))
    log.info("rank %d: stopped", rank)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


def run_external_worker(config) -> int:
    """Entry point of a rank > 0 started by torchrun (or with RANK/WORLD_SIZE set by hand)."""
    rank, world, local_rank = external_launch()
    if world != config.tensor_parallel_size:
        raise SystemExit(f"tensor_parallel_size: {config.tensor_parallel_size}, but WORLD_SIZE is {world}")
    try:
        return run_worker(config, rank, world, local_rank, config.distributed_init_method or "env://")
    except TensorParallelError as e:
        log.error("%s", e)
        return 1
