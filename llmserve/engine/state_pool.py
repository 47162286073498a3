"""The recurrent state pool of hybrid models (LFM2's short convolutions, Mamba-2 / DeltaNet layers): a fixed
number of slots, each holding every recurrent layer's fixed-size state for one sequence, beside the paged KV
cache that the attention layers keep.

The contract, for the engine and for model files:

  * A layer with recurrent state declares it: its `cache_kind(...)` is a `RecurrentState` holding the shapes of its
    state tensors for one sequence (LFM2's conv: ((kernel - 1, hidden),); model/layers/cache_kinds.py), which
    `KVPlan.state_shapes` lists per layer (None: an attention layer, which keeps KV blocks);
    `ModelConfig.recurrent_layers` says the same from the config alone (before the model is built: KV bytes per
    block count attention layers only).
  * The runner allocates, per recurrent layer, one tensor [num_slots, *shape] for each of its shapes, and passes
    the layer that tuple in place of its KV cache. `AttentionMetadata.states` (model/attention.py
    `StateMetadata`) gives, per sequence of the step in batch order (decodes first), its slot, its rows and
    whether its state starts fresh (the sequence's first chunk: the runner has zeroed its slot already).
    A layer reads its sequences' states from their slots and writes them back after the step's tokens; chunked
    prefill carries the state from chunk to chunk, and decodes and prefills share one step.
  * `StatePool` (here, bookkeeping only, no tensors) hands out the slots: `KVCacheManager.allocate_slots` takes one
    when a sequence is first scheduled (no slot free: the request waits, as for want of blocks), and
    `KVCacheManager.free` gives it back when the sequence finishes, is aborted, fails or is preempted. A preempted
    sequence is recomputed from its tokens (num_computed_tokens 0: fresh), as its KV is. A slot is never shared.
  * Prefix caching is off for these models (a cached block holds attention KV, not the recurrent state at its end:
    vLLM's hybrid allocator checkpoints the state at block boundaries instead); speculative decoding (n-gram or a
    draft model, whose rejected tokens would have to be taken back out of the state), tensor parallelism, LoRA and
    the disk KV tier are refused at start-up.
  * The pool's bytes (slots x every layer's state) come out of the KV budget (kv_plan.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from llmserve.model.attention import StateMetadata

log = logging.getLogger("llmserve.engine")

StateShapes = tuple[tuple[int, ...], ...]


class StatePool:
    """Slots of recurrent state, one per running sequence."""

    def __init__(self, num_slots: int, shapes: list[StateShapes | None] | None = None) -> None:
        self.num_slots = num_slots
        self.shapes = shapes or []  # per layer: its state shapes, or None (attention)
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.slot_of: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def has_slot(self, request_id: str) -> bool:
        return request_id in self.slot_of

    def allocate(self, request_id: str) -> int:
        """The request's slot, taken now if it has none (the caller has checked `num_free`)."""
        slot = self.slot_of.get(request_id)
        if slot is None:
            if not self._free:
                raise ValueError("no free state slot")
            slot = self.slot_of[request_id] = self._free.pop()
        return slot

    def free(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, request_id: str) -> int:
        return self.slot_of[request_id]

    def tensors(self, layer: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s state tensors, [num_slots, *shape] each, zeroed."""
        return tuple(torch.zeros((self.num_slots, *s), dtype=dtype, device=device) for s in self.shapes[layer])


def hybrid_config(config, mc):
    """The engine's config for a hybrid model (`mc.recurrent_layers`): prefix caching off (one log line); what its
    recurrent state cannot follow refused at start-up. Other models: `config` as it is."""
    if not any(mc.recurrent_layers):
        return config
    what = None
    if config.num_lookahead_tokens > 0:
        what = "speculative decoding (--speculative-ngram / --speculative-model)"
    elif config.tensor_parallel_size > 1:
        what = "tensor parallelism (--tensor-parallel-size > 1)"
    elif config.enable_lora:
        what = "LoRA adapters (--enable-lora)"
    elif config.kv_cache_dir:
        what = "the disk KV tier (--kv-cache-dir)"
    elif config.kv_cache_url:
        what = "the shared KV store (--kv-cache-url)"
    if what is not None:
        raise ValueError(
            f"model: {mc.architecture} keeps a recurrent state per sequence (a hybrid model); {what} is not "
            "supported with it"
        )
    if config.enable_prefix_caching:
        log.info("prefix caching off: %s keeps a recurrent state per sequence, which blocks lack", mc.architecture)
        config = dataclasses.replace(config, enable_prefix_caching=False)
    return config


def step_states(order, sched, device: torch.device, caches: list) -> StateMetadata:
    """The step's StateMetadata for the requests in `order` (the runner's batch order: decodes first; their slots in
    `sched.state_slots`), and the slots
    of those starting fresh (first chunk, or recomputed after preemption) zeroed in every state tensor `caches`
    holds (the per-layer caches: a tuple of state tensors for a recurrent layer)."""
    slots, starts, lens, fresh = [], [], [], []
    row = num_decodes = 0
    for req in order:
        n = sched.num_scheduled_tokens[req.request_id]
        slots.append(sched.state_slots[req.request_id])
        starts.append(row)
        lens.append(n)
        fresh.append(req.num_computed_tokens == 0)
        num_decodes += n == 1 and row == num_decodes  # (a leading run of one-row sequences)
        row += n
    zero = [s for s, f in zip(slots, fresh) if f]
    if zero:
        at = torch.tensor(zero, dtype=torch.long, device=device)
        for cache in caches:
            if isinstance(cache, tuple):
                for t in cache:
                    t.index_fill_(0, at, 0)
    return StateMetadata(
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        slot_list=slots,
        query_start=starts,
        query_len=lens,
        fresh=torch.tensor(fresh, dtype=torch.bool, device=device),
        num_decodes=num_decodes,
    )
