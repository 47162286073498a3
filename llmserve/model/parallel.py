"""Tensor parallelism for the Llama decoder: which heads and columns each rank holds, and the shards.

Megatron-style, over N ranks:

* attention: Q/K/V are column-parallel (each rank computes its own heads), `o_proj` is row-parallel
  (each rank multiplies its heads' slice of the input dimension) followed by an all-reduce (sum);
* MLP: gate/up are column-parallel, `down_proj` row-parallel followed by an all-reduce;
* the embedding, the final norm and `lm_head` are replicated (they are small next to the layers
  for the models llmserve runs; only rank 0's logits are used).

How heads are split (`plan_heads`):

* KV heads >= N: the KV heads are dealt out in contiguous runs as evenly as possible, and each rank
  takes the query heads of its KV heads. Even counts give the usual even split; uneven ones (the
  bundled SmolLM2-135M has 9 query / 3 KV heads: 6+3 at N=2) still give each rank whole GQA groups,
  so no KV head is stored twice.
* KV heads < N (e.g. 8 query heads, 2 KV heads, N=4): the query heads are split as evenly as possible
  and each rank stores a replica of the KV heads its query heads read (replicated KV heads). Where a
  rank's query heads would read its KV heads unevenly, the rank keeps one KV head per query head.
* N greater than the number of query heads is refused at start-up with a clear message.

A rank's shard is a smaller model of the same class: a `ModelConfig` with its local head counts and
intermediate size, loaded from sliced Hugging Face weights by the ordinary `load_hf_state_dict`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmserve.model.config import ModelConfig
from llmserve.model.families.llama import LlamaModel
from llmserve.model.layers.linear import PACKED_PROJECTIONS
from llmserve.model.loader import build_model, checkpoint_names
from llmserve.model.registry import arch_spec


@dataclass(frozen=True)
class RankShard:
    rank: int
    q_heads: tuple[int, ...]  # global query heads of this rank (contiguous)
    kv_heads: tuple[int, ...]  # global KV head stored in each local KV slot (may repeat)
    mlp_cols: tuple[int, int]  # [start, end) of the intermediate dimension

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def _even(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous runs over range(n), sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, s = [], 0
    for i in range(parts):
        e = s + base + (1 if i < extra else 0)
        out.append((s, e))
        s = e
    return out


def plan_heads(cfg: ModelConfig, world_size: int) -> list[RankShard]:
    """The shard of every rank; raises ValueError (a start-up error) where the model cannot split."""
    n, h, hkv = world_size, cfg.num_heads, cfg.num_kv_heads
    if n < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {n}")
    if n > 1 and not arch_spec(cfg.architecture).tensor_parallel:  # (the family's spec: ArchSpec.tensor_parallel)
        raise ValueError(
            f"tensor_parallel_size: {cfg.architecture} is not split yet (experts and packed "
            f"checkpoint projections); use --tensor-parallel-size 1"
        )
    if h % hkv:
        raise ValueError(f"model: {h} attention heads are not a multiple of {hkv} KV heads")
    if n > h:
        raise ValueError(
            f"tensor_parallel_size: {n} is more than the model's {h} attention heads; "
            f"use at most {h} (the heads are what is split)"
        )
    if n > cfg.intermediate_size:
        raise ValueError(f"tensor_parallel_size: {n} is more than the MLP width {cfg.intermediate_size}")
    group = h // hkv  # query heads per KV head
    mlp = _even(cfg.intermediate_size, n)
    shards = []
    if hkv >= n:
        for r, (ks, ke) in enumerate(_even(hkv, n)):
            shards.append(RankShard(r, tuple(range(ks * group, ke * group)), tuple(range(ks, ke)), mlp[r]))
        return shards
    for r, (qs, qe) in enumerate(_even(h, n)):
        q = tuple(range(qs, qe))
        reads = [j // group for j in q]  # the KV head each query head reads
        runs: list[int] = []  # lengths of runs of the same KV head
        for i, kv in enumerate(reads):
            if i and kv == reads[i - 1]:
                runs[-1] += 1
            else:
                runs.append(1)
        if len(set(runs)) == 1:  # uniform local GQA: one replica of each KV head read
            kv = tuple(dict.fromkeys(reads))
        else:  # uneven: one KV slot per query head (plain MHA locally)
            kv = tuple(reads)
        shards.append(RankShard(r, q, kv, mlp[r]))
    return shards


def local_config(cfg: ModelConfig, shard: RankShard) -> ModelConfig:
    s, e = shard.mlp_cols
    return dataclasses.replace(cfg, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads, intermediate_size=e - s)


def shard_hf_state_dict(
    weights: dict[str, torch.Tensor], cfg: ModelConfig, shard: RankShard
) -> dict[str, torch.Tensor]:
    """Hugging Face-named weights -> this rank's slices, still Hugging Face-named (unpacked: the parts
    of layers.PACKED_PROJECTIONS are column-parallel, o_proj and down_proj row-parallel)."""
    d = cfg.head_dim
    q_rows = torch.cat([torch.arange(j * d, (j + 1) * d) for j in shard.q_heads])
    kv_rows = torch.cat([torch.arange(j * d, (j + 1) * d) for j in shard.kv_heads])
    s, e = shard.mlp_cols
    q_part, *kv_parts = PACKED_PROJECTIONS["qkv_proj"]
    out = {}
    for name, w in weights.items():
        layer = name.split(".")[-2]  # model.layers.0.self_attn.q_proj.weight -> q_proj
        if layer == q_part:
            out[name] = w.index_select(0, q_rows)
        elif layer in kv_parts:
            out[name] = w.index_select(0, kv_rows)
        elif layer in PACKED_PROJECTIONS["gate_up_proj"]:
            out[name] = w[s:e]
        elif name.endswith(".o_proj.weight"):
            out[name] = w.index_select(1, q_rows)  # row-parallel: input columns
        elif name.endswith(".down_proj.weight"):
            out[name] = w[:, s:e]
        elif name.endswith((".down_proj.bias", ".o_proj.bias")):
            out[name] = w if shard.rank == 0 else torch.zeros_like(w)  # added once, after the sum
        else:
            out[name] = w  # replicated
    return {k: v.contiguous() for k, v in out.items()}


def load_sharded_model(
    weights: dict[str, torch.Tensor],
    cfg: ModelConfig,
    shard: RankShard,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    all_reduce,
) -> LlamaModel:
    """This rank's model: local head counts, sliced weights, `all_reduce` after o_proj and down_proj."""
    lcfg = local_config(cfg, shard)
    sliced = shard_hf_state_dict(weights, cfg, shard)
    model = build_model(lcfg, checkpoint_names(cfg, sliced), device, dtype, max_positions)
    del sliced
    model.set_all_reduce(all_reduce)
    return model
