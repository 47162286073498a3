"""The KV plan: how the KV budget is spent, decided in one place, from plain values (no model, no tensors);
and the KV cache manager built from it (`kv_manager`).

Each layer declares its cache kind (`layer.cache_kind(...)`: llmserve/model/layers/cache_kinds.py):

    FullAttention(kv_heads, head_dim, dtype)           keys and values of every position, in paged blocks
    SlidingWindow(kv_heads, head_dim, dtype, window)   the same, but only the last `window` positions are read:
                                                       its own pool, where passed blocks go back (kv_window.py)
    RecurrentState(shapes, dtype)                      a fixed-size state per sequence (state_pool.py), no blocks

`plan(config, layers, memory, ...)` turns the budget (--num-kv-blocks, --kv-cache-memory, or what `memory`
measured: kv_memory.py) into a `KVPlan`: the blocks of each pool, the state slots, the disk tier's settings,
the resulting max_model_len, and the log lines that say so. The engine builds everything from it: the runner's
tensors, the KV cache manager's pools, the scheduler's length limit. A new cache kind is a layer kind here and
a case in `plan`; a new cache tier is a setting here (as `DiskPlan`, `StorePlan`) and an object the KV manager
is given (kv_tiers.open_kv_tiers stacks them).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.kv_window import WindowGroup
from llmserve.engine.state_pool import StatePool
from llmserve.model.layers.cache_kinds import FullAttention, LayerKind, RecurrentState, SlidingWindow
from llmserve.model.memory import CgroupLimit

GiB = 1 << 30
MiB = 1 << 20
CPU_SHARE = 0.25  # of the available memory, on CPU
CPU_MOST = 8 * GiB


def layer_kinds(model, kv_heads: int, kv_dtype: torch.dtype, state_dtype: torch.dtype) -> list[LayerKind]:
    """What each layer of a built model keeps, as the layer declares it (`cache_kind`, model/layers/cache_kinds.py).
    `kv_heads`: the KV heads a rank holds (the largest share under tensor parallelism)."""
    return [layer.cache_kind(kv_heads, kv_dtype, state_dtype) for layer in model.layers]


def config_kinds(mc, kv_heads: int, kv_dtype: torch.dtype) -> list[LayerKind]:
    """The layer kinds as far as the model's config tells them before the model is built (every attention layer
    as full attention, recurrent ones without their shapes): enough to price a block."""
    recurrent = mc.recurrent_layers or (False,) * mc.num_layers
    return [RecurrentState((), kv_dtype) if r else FullAttention(kv_heads, mc.head_dim, kv_dtype) for r in recurrent]


def bytes_per_block(layers: list[LayerKind], block_size: int) -> int:
    """One block of every attention layer (a recurrent layer keeps a state per sequence instead)."""
    return sum(k.block_bytes(block_size) for k in layers if isinstance(k, FullAttention))


# -- what the engine has measured -------------------------------------------------------------------
@dataclass(frozen=True)
class Memory:
    """What the KV cache may take, as measured (kv_memory.measure_memory). CPU: `available` is what this process
    may still take (the host's RAM, or less under a cgroup `limit`); CUDA: the device's share under
    --gpu-memory-utilization less other processes' use, and `activations` one forward's peak. Nothing is measured
    where --num-kv-blocks or --kv-cache-memory decides."""

    device_type: str = "cpu"
    available: int = 0
    activations: int = 0
    limit: CgroupLimit | None = None


# -- the plan ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WindowPlan:
    num_blocks: int  # the sliding-window layers' own pool
    window: int


@dataclass(frozen=True)
class DiskPlan:
    """--kv-cache-dir: where, how large, and what a file's KV depends on (kv_disk.open_disk_tier)."""

    root: str
    max_bytes: int
    size_gib: float
    settings: dict


@dataclass(frozen=True)
class StorePlan:
    """--kv-cache-url: the shared store every replica reads and writes (kv_remote.open_remote_tier), and what a block's
    KV depends on (the same settings as the disk tier's: one fingerprint for both)."""

    url: str
    password_file: str | None
    timeout: float
    settings: dict


@dataclass(frozen=True)
class KVPlan:
    block_size: int
    num_blocks: int  # the full-attention pool: the KV manager's blocks, every non-window layer's tensor
    budget_blocks: int  # blocks of every layer the budget holds, the state pool's bytes taken off (a draft's pool)
    bytes_per_block: int
    budget: int  # bytes
    max_model_len: int
    enable_caching: bool
    layers: tuple[LayerKind, ...] = ()
    window: WindowPlan | None = None  # None: every attention layer keeps its blocks in the main pool
    state_slots: int = 0  # recurrent state slots (0: no recurrent layer)
    disk: DiskPlan | None = None
    store: StorePlan | None = None
    lines: tuple[str, ...] = ()  # what was decided, for the log
    warnings: tuple[str, ...] = ()

    def log(self, logger) -> None:
        for line in self.lines:
            logger.info("%s", line)
        for line in self.warnings:
            logger.warning("%s", line)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def window_layers(self) -> list[bool]:
        """Per layer: whether its blocks are in the window pool (only where the plan split one off)."""
        return [self.window is not None and isinstance(k, SlidingWindow) for k in self.layers]

    @property
    def state_shapes(self) -> list[tuple[tuple[int, ...], ...] | None]:
        return [k.shapes if isinstance(k, RecurrentState) else None for k in self.layers]

    def for_draft(self, num_layers: int, kv_heads: int, head_dim: int) -> "KVPlan":
        """A draft model's plan: the whole budget's blocks in one pool for every layer, no prefix caching, no
        window split, state or tier."""
        layer = FullAttention(kv_heads, head_dim, self.layers[0].dtype if self.layers else torch.float32)
        return dataclasses.replace(
            self,
            num_blocks=self.budget_blocks,
            enable_caching=False,
            layers=(layer,) * num_layers,
            window=None,
            state_slots=0,
            disk=None,
            store=None,
            lines=(),
            warnings=(),
        )


def requested_bytes(config, mc, kv_heads: int, kv_dtype: torch.dtype) -> int:
    """The KV bytes asked for explicitly (--kv-cache-memory, --num-kv-blocks; 0: sized after the load), for the
    loader's does-it-fit check; a --max-model-len beyond the model's positions refused first."""
    check_length(config, mc.max_position_embeddings)
    per_block = bytes_per_block(config_kinds(mc, kv_heads, kv_dtype), config.block_size)
    return int((config.kv_cache_memory or 0) * GiB) or (config.num_kv_blocks or 0) * per_block


def check_length(config, model_max: int) -> None:
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len: {config.max_model_len} is more than the model's "
            f"{model_max} positions; lower --max-model-len"
        )


def plan(config, layers: list[LayerKind], memory: Memory, *, model_max: int, token_budget: int) -> KVPlan:
    """The KV plan for `layers` under `config`'s settings and the `memory` measured. `model_max`: the model's
    positions; `token_budget`: the most tokens a step computes (--max-num-batched-tokens)."""
    bs = config.block_size
    lines: list[str] = []
    per_block = bytes_per_block(layers, bs)
    num_blocks, budget = _budget(config, per_block, memory, lines)
    slots, num_blocks = _states(config, layers, num_blocks, budget, per_block, lines)
    budget_blocks = num_blocks
    length = min(model_max, config.max_model_len or model_max)
    num_blocks, window = _window_split(config, layers, num_blocks, length, token_budget, lines)
    capacity = num_blocks * bs
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(
            f"max_model_len: {config.max_model_len} tokens do not fit in the KV cache "
            f"({num_blocks} blocks of {bs} = {capacity} tokens, {budget / GiB:.2f} GiB); "
            f"raise --kv-cache-memory (or --gpu-memory-utilization) or lower --max-model-len"
        )
    warnings: list[str] = []
    settings = _tier_settings(config, layers, bs)
    return KVPlan(
        block_size=bs,
        num_blocks=num_blocks,
        budget_blocks=budget_blocks,
        bytes_per_block=per_block,
        budget=budget,
        max_model_len=config.max_model_len or min(model_max, capacity),
        enable_caching=config.enable_prefix_caching,
        layers=tuple(layers),
        window=window,
        state_slots=slots,
        disk=_disk(config, settings, warnings),
        store=_store(config, settings, warnings),
        lines=tuple(lines),
        warnings=tuple(warnings),
    )


def _budget(config, per_block: int, memory: Memory, lines: list[str]) -> tuple[int, int]:
    """(blocks of `per_block` bytes, the budget in bytes): --num-kv-blocks, --kv-cache-memory, on CUDA
    --gpu-memory-utilization's share less the activations' peak, on CPU a quarter of the available memory up to
    8 GiB."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, config.num_kv_blocks * per_block
    if config.kv_cache_memory is not None:
        budget = int(config.kv_cache_memory * GiB)
    elif memory.device_type == "cuda":
        budget = memory.available - memory.activations
    else:
        budget = min(int(memory.available * CPU_SHARE), CPU_MOST)
        where = (
            f"under the cgroup memory limit of {memory.limit.limit / GiB:.2f} GiB, {memory.limit.path}"
            if memory.limit
            else "the host's RAM"
        )
        lines.append(
            f"KV budget: a quarter of the {memory.available / GiB:.2f} GiB available ({where}), at most 8 GiB: "
            f"{budget / GiB:.2f} GiB"
        )
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory: the KV budget ({budget / GiB:.3f} GiB) holds no block of "
            f"{per_block / MiB:.2f} MiB; raise --kv-cache-memory or --gpu-memory-utilization"
        )
    return int(num_blocks), int(budget)


def _states(config, layers, num_blocks: int, budget: int, per_block: int, lines: list[str]) -> tuple[int, int]:
    """(state slots, the KV blocks left beside them): a slot per running sequence (--max-num-seqs; a preempted
    sequence gives its slot back first), its bytes out of the KV budget (not out of an explicit --num-kv-blocks)."""
    recurrent = [k for k in layers if isinstance(k, RecurrentState)]
    if not recurrent:
        return 0, num_blocks
    slots = config.max_num_seqs
    per_slot = sum(k.slot_bytes() for k in recurrent)
    nbytes = slots * per_slot
    if config.num_kv_blocks is None:
        num_blocks = (budget - nbytes) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: the recurrent state of {slots} sequences takes {nbytes / MiB:.1f} "
                f"MiB of the KV budget ({budget / MiB:.1f} MiB), which leaves no KV block; raise "
                "--kv-cache-memory or lower --max-num-seqs"
            )
    lines.append(
        f"{len(recurrent)} of {len(layers)} layers keep a recurrent state: a pool of {slots} slots x "
        f"{per_slot / 1024:.1f} KiB = {nbytes / MiB:.2f} MiB, out of the KV budget"
    )
    return slots, int(num_blocks)


def _window_split(config, layers, num_blocks: int, length: int, token_budget: int, lines: list[str]):
    """(the full-attention layers' pool, the window layers' WindowPlan): the budget of `num_blocks` blocks of every
    attention layer split between them for sequences of `length` tokens. (num_blocks, None) where every layer keeps
    its blocks: one kind of layer, or --disable-hybrid-kv-cache-manager, --kv-cache-dir (its files hold every layer's
    block), tensor parallelism."""
    attn = [k for k in layers if isinstance(k, FullAttention)]
    windowed = [isinstance(k, SlidingWindow) for k in attn]
    if not any(windowed) or config.disable_hybrid_kv_cache_manager:
        return num_blocks, None
    if config.kv_cache_dir or config.tensor_parallel_size > 1:
        why = "--kv-cache-dir" if config.kv_cache_dir else "tensor parallelism"
        lines.append(f"sliding-window layers keep every block (not with {why})")
        return num_blocks, None
    bs = config.block_size
    window = next(k.window for k in attn if isinstance(k, SlidingWindow))
    if not all(windowed):  # (with every layer windowed, a sequence's length costs no KV: the model's)
        length = min(length, num_blocks * bs)
    length = config.max_model_len or length
    full_need = -(-length // bs)
    window_need = min(full_need, WindowGroup(0, bs, window, False).blocks_per_sequence(min(token_budget, length)))
    nf, nw = split_kv_blocks(num_blocks, windowed, full_need, window_need, config.max_num_seqs * full_need)
    lines.append(
        f"{sum(windowed)} of {len(windowed)} layers attend to a window of {window}: their own pool of {nw} blocks "
        f"(their passed blocks go back), {nf} blocks for the others"
    )
    return nf, WindowPlan(nw, window)


def split_kv_blocks(
    num_blocks: int, layers: list[bool], full_need: int, window_need: int, most_full: int
) -> tuple[int, int]:
    """A budget of `num_blocks` blocks of every layer split into (full-attention pool blocks, window pool
    blocks) in proportion to what one sequence needs of each at its longest (`full_need`, `window_need`
    blocks); the window pool holds at least one sequence. Without full-attention layers the first pool is
    bookkeeping only (no tensors): as large as the window pool's sequences need, at most `most_full`."""
    num_window = sum(layers)
    num_full = len(layers) - num_window
    units = num_blocks * len(layers)  # the budget in blocks of one layer
    if num_full == 0:
        nw = num_blocks
        return max(full_need, min(-(-nw * full_need // window_need), most_full)), nw
    nf = units * full_need // (num_full * full_need + num_window * window_need)
    nw = max(window_need, (units - nf * num_full) // num_window)
    return (units - nw * num_window) // num_full, nw


def _tier_settings(config, layers, block_size: int) -> dict:
    """What a block's numbers depend on besides the model's files and weights' dtype: part of the tiers' fingerprint."""
    attn = next((k for k in layers if isinstance(k, FullAttention)), None)
    if attn is None:
        return {}
    return dict(
        format=1,
        quantization=config.quantization or "none",
        kv_dtype=str(attn.dtype).removeprefix("torch."),
        block_size=block_size,
        layers=len(layers),
        kv_heads=attn.kv_heads,
        head_dim=attn.head_dim,
    )


def _tier_refused(config) -> str | None:
    """Why a tier below RAM cannot run with this config (None: it can)."""
    if not config.enable_prefix_caching:
        return "it needs prefix caching (drop --no-enable-prefix-caching)"
    if config.tensor_parallel_size > 1:
        return "not supported with --tensor-parallel-size > 1 yet"
    if config.speculative_model:
        return "not supported with --speculative-model yet (the draft's KV is not stored)"
    return None


def _disk(config, settings: dict, warnings: list[str]) -> DiskPlan | None:
    """--kv-cache-dir's settings, or None (with a warning where it cannot run)."""
    if not config.kv_cache_dir:
        return None
    why = _tier_refused(config)
    if why:
        warnings.append(f"kv disk: --kv-cache-dir ignored: {why}")
        return None
    root = os.path.abspath(os.path.expanduser(config.kv_cache_dir))
    return DiskPlan(root, int(config.kv_cache_dir_size * GiB), config.kv_cache_dir_size, settings)


def _store(config, settings: dict, warnings: list[str]) -> StorePlan | None:
    """--kv-cache-url's settings, or None (with a warning where it cannot run)."""
    if not config.kv_cache_url:
        return None
    why = _tier_refused(config)
    if why:
        warnings.append(f"kv store: --kv-cache-url ignored: {why}")
        return None
    return StorePlan(config.kv_cache_url, config.kv_cache_url_password_file, config.kv_cache_url_timeout, settings)


def kv_manager(plan: KVPlan, events=None, disk=None) -> KVCacheManager:
    """The KV cache manager with the pools `plan` decided and the tiers opened for it (events, disk)."""
    window = None
    if plan.window is not None:
        window = WindowGroup(plan.window.num_blocks, plan.block_size, plan.window.window, plan.enable_caching)
    states = StatePool(plan.state_slots, plan.state_shapes) if plan.state_slots else None
    return KVCacheManager(
        plan.num_blocks, plan.block_size, plan.enable_caching, window=window, states=states, events=events, disk=disk
    )
