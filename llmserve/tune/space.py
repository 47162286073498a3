"""The flags `llmserve tune` searches, derived from the model and the machine (not fixed lists).

A candidate is a dict of these parameters (the names Optuna records):
  replicas                servers on this machine behind the router (`llmserve launch`); each gets cores / replicas
                          threads (1 x 2 threads vs 2 x 1 on two cores)
  max_num_seqs            powers of two from 8 up to what the KV cache holds at the workload's request length
  max_num_batched_tokens  the engine's own default for the model's cost per token at that thread count
                          (llmserve/engine/scheduler.py), halved and doubled
  max_step_ms             the step-time target beside decoding rows (llmserve/engine/step_budget.py): the CPU default
                          (850 ms), and the SLO's TPOT (or ITL) bound and twice it: a stream's TPOT is the mean of
                          the steps it waits through, so a target at the bound keeps prefill chunks from pushing it
                          over (one choice, no target, on CUDA)
  dtype                   float32, and bfloat16 where the CPU computes it natively (AVX512-BF16, AMX) or on CUDA
  quantization            none, int8, int4 (weight-only); for a GGUF file with quantized blocks (the bundled model is
                          one: Q4_1), gguf first, its own blocks, which is what `llmserve serve` picks by default
  kv_cache_dtype          auto (= dtype), int8
  speculative_ngram       0 or 4 (prompt lookup, verified in one forward)
  enable_prefix_caching   on, off
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

KNOBS = (
    "replicas",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_step_ms",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "speculative_ngram",
    "enable_prefix_caching",
)
# the order the coordinate moves try the knobs in (the articles' order of what pays most on a CPU first)
MOVE_ORDER = (
    "quantization",
    "replicas",
    "max_num_batched_tokens",
    "max_step_ms",
    "max_num_seqs",
    "dtype",
    "kv_cache_dtype",
    "speculative_ngram",
    "enable_prefix_caching",
)
ENGINE_DEFAULT_SEQS = 64  # EngineConfig.max_num_seqs
KV_GIB_DEFAULT = 8.0  # the CPU cache's ceiling (EngineConfig.kv_cache_memory's default, at most 8 GiB)


@dataclass
class Space:
    """Each knob's choices (Optuna categorical), the defaults `llmserve serve` would use, and the machine."""

    choices: dict[str, list]
    defaults: dict
    cores: int
    notes: list[str] = field(default_factory=list)

    def size(self) -> int:
        return math.prod(len(v) for v in self.choices.values())

    def key(self, params: dict) -> str:
        return ",".join(f"{k}={params[k]}" for k in KNOBS)

    def moves(self, base: dict) -> list[dict]:
        """Every candidate one knob away from `base`, in MOVE_ORDER: the articles' change-one-flag steps. A step
        from a GGUF's own blocks to `--quantization none` is taken as a user takes it, with `--dtype auto`: the
        blocks widened to bfloat16 where the CPU has it (float32 weights, the exactness mode, stay a choice
        of the sampler, not the first step: at 1B it is a 0.9 s/token server that eats minutes of the budget)."""
        out = []
        float_dtype = "bfloat16" if "bfloat16" in self.choices["dtype"] else "float32"
        for k in MOVE_ORDER:
            for v in self.choices[k]:
                if v != base[k]:
                    move = {**base, k: v}
                    if k == "quantization" and v == "none" and base[k] == "gguf":
                        move["dtype"] = float_dtype
                    out.append(move)
        return out


def grid_seeds(sp: Space, count: int) -> list[dict]:
    """The first `count` points vLLM's auto_tune grid would measure, in this space: one server, the other flags at
    their defaults, --max-num-seqs x --max-num-batched-tokens at the corners the space derives around the defaults
    (auto_tune.sh's lists start at a larger max-num-seqs and chunk budget than the engine's defaults). In order:
    the defaults; the largest chunk budget; the largest max-num-seqs; both; the smallest chunk budget; the smallest
    chunk budget with the largest max-num-seqs. Duplicates (a knob with one choice) are dropped."""
    d = sp.defaults
    seqs, budgets = sp.choices["max_num_seqs"], sp.choices["max_num_batched_tokens"]
    corners = [
        (d["max_num_seqs"], d["max_num_batched_tokens"]),
        (d["max_num_seqs"], max(budgets)),
        (max(seqs), d["max_num_batched_tokens"]),
        (max(seqs), max(budgets)),
        (d["max_num_seqs"], min(budgets)),
        (max(seqs), min(budgets)),
    ]
    out: list[dict] = []
    for s, b in corners:
        p = {**d, "replicas": 1, "max_num_seqs": s, "max_num_batched_tokens": b}
        if p not in out:
            out.append(p)
    return out[: max(1, count)]  # the defaults at least: the baseline every report compares with


def changes_answers(params: dict) -> bool:
    """Whether a candidate's answers can differ from float32's (what the quality guard measures)."""
    return (
        params["dtype"] != "float32"
        or params["quantization"] != "none"
        or params["kv_cache_dtype"] not in ("auto", "float32")
    )


def threads_per_replica(params: dict, cores: int) -> int:
    return max(1, cores // params["replicas"])


def serve_settings(params: dict, cores: int) -> dict:
    """The `llmserve serve` settings of a candidate (YAML keys: flag names with underscores); `replicas` and
    the total `num_threads` for `llmserve launch` when there are several."""
    out = {
        "max_num_seqs": params["max_num_seqs"],
        "max_num_batched_tokens": params["max_num_batched_tokens"],
        "max_step_ms": params["max_step_ms"],
        "dtype": params["dtype"],
        "quantization": params["quantization"],
        "kv_cache_dtype": params["kv_cache_dtype"],
        "enable_prefix_caching": params["enable_prefix_caching"],
    }
    if params["speculative_ngram"]:
        out["speculative_ngram"] = params["speculative_ngram"]
    if params["replicas"] > 1:
        out["replicas"] = params["replicas"]
        out["num_threads"] = threads_per_replica(params, cores) * params["replicas"]  # launch splits the total
    else:
        out["num_threads"] = cores
    return out


def serve_argv(params: dict, cores: int) -> list[str]:
    """The candidate's settings as `llmserve serve` / `llmserve launch` flags."""
    argv: list[str] = []
    for key, value in serve_settings(params, cores).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def _pow2_around(center: int, lo: int, hi: int) -> list[int]:
    return sorted({min(hi, max(lo, v)) for v in (center // 2, center, center * 2)})


def derive(
    flops_per_token: int,
    kv_bytes_per_token: int,
    request_tokens: float,
    cores: int,
    bf16: bool,
    max_replicas: int | None = None,
    device: str = "cpu",
    file_blocks: str | None = None,
    step_bound_ms: float | None = None,
    int8_dots: bool = False,
) -> Space:
    """The space for a model (its projections' FLOPs per token, its KV bytes per token in float32), a workload
    (mean prompt + output tokens of a request) and a machine (cores, native bfloat16). `file_blocks`: the file's
    quantized block formats when `--quantization auto` serves them as they are (a GGUF: "Q4_1/Q8_0"); `gguf` is
    then the defaults' quantization and a choice beside none / int8 / int4. `step_bound_ms`: the SLO's bound on a
    stream's gaps (its TPOT or ITL bound), the step-time targets searched beside the default. `int8_dots`: the CPU
    sums int8 products itself (VNNI / AMX): `w8a8` (one-level int8 activations) is then a choice too."""
    from llmserve.engine.scheduler import default_token_budget
    from llmserve.engine.step_budget import CPU_STEP_MS

    notes = []
    limit = max(1, min(cores, max_replicas or cores))
    replicas = [r for r in range(1, limit + 1) if cores % r == 0]
    if device == "cuda":
        replicas = [1]
    budgets: set[int] = set()
    for r in replicas:
        budgets.update(_pow2_around(default_token_budget(flops_per_token, device, cores // r), 64, 4096))
    default_budget = default_token_budget(flops_per_token, device, cores)
    kv_tokens = KV_GIB_DEFAULT * 2**30 / max(1, kv_bytes_per_token)
    fit = max(8, int(kv_tokens / max(1.0, request_tokens)))
    seqs = [s for s in (8, 16, 32, 64, 128, 256) if s <= fit] or [8]
    if fit < 256:
        notes.append(
            f"max_num_seqs up to {seqs[-1]}: the KV cache holds ~{fit} requests of {request_tokens:.0f} tokens"
        )
    dtypes = ["float32", "bfloat16"] if bf16 or device == "cuda" else ["float32"]
    if len(dtypes) == 1:
        notes.append("no bfloat16: this CPU has no native bfloat16 matmuls (AVX512-BF16 or AMX)")
    default_step = int(CPU_STEP_MS) if device == "cpu" else 0  # 0: no target (`--max-step-ms 0`)
    steps = {default_step}
    if device == "cpu" and step_bound_ms:
        steps.update(v for v in (int(step_bound_ms), int(2 * step_bound_ms)) if 0 < v < default_step)
    choices = {
        "replicas": replicas,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": sorted(budgets),
        "max_step_ms": sorted(steps),
        "dtype": dtypes,
        "quantization": (["gguf"] if file_blocks else [])
        + ["none", "int8", "int4"]
        + (["w8a8"] if int8_dots and device == "cpu" else []),
        "kv_cache_dtype": ["auto", "int8"],
        "speculative_ngram": [0, 4],
        "enable_prefix_caching": [True, False],
    }
    defaults = {
        "replicas": 1,
        "max_num_seqs": min(ENGINE_DEFAULT_SEQS, seqs[-1]) if ENGINE_DEFAULT_SEQS in seqs else seqs[-1],
        "max_num_batched_tokens": default_budget,
        "max_step_ms": default_step,
        # what --dtype auto picks: bfloat16 for float weights where native, float32 around quantized blocks
        "dtype": "bfloat16" if (bf16 or device == "cuda") and not file_blocks else "float32",
        "quantization": "gguf" if file_blocks else "none",  # what --quantization auto picks
        "kv_cache_dtype": "auto",
        "speculative_ngram": 0,
        "enable_prefix_caching": True,
    }
    if file_blocks:
        notes.append(f"quantization gguf: the file's own {file_blocks} blocks, what `llmserve serve` runs by default")
    for k, v in defaults.items():  # the defaults are always a point of the space
        if v not in choices[k]:
            choices[k] = (
                sorted([*choices[k], v]) if isinstance(v, int) and not isinstance(v, bool) else [*choices[k], v]
            )
    return Space(choices, defaults, cores, notes)


def for_model(
    model: str | None, request_tokens: float, max_replicas: int | None = None, gap_ms: float | None = None
) -> Space:
    """`derive` for a model as `llmserve serve --model` takes it, on this machine (its config only, no weights)."""
    from llmserve.model.formats import bf16
    from llmserve.model.kernels.cpu_ext import cpu_has_int8_dots
    from llmserve.model.loader.load import load_model_config
    from llmserve.model.loader.lookup import resolve_model

    source = resolve_model(model)
    mc, _ = load_model_config(source)
    kv_layers = mc.num_layers - sum(mc.recurrent_layers) if mc.recurrent_layers else mc.num_layers
    kv_bytes = 2 * kv_layers * mc.num_kv_heads * mc.head_dim * 4
    cores = len(os.sched_getaffinity(0))
    flops, blocks = mc.matmul_flops_per_token(), _blocks(source, mc)
    native = bf16.supported()
    return derive(
        flops, kv_bytes, request_tokens, cores, native, max_replicas, "cpu", blocks, gap_ms, cpu_has_int8_dots()
    )


def _blocks(source, mc) -> str | None:
    """The quantized block formats `--quantization auto` serves as they are (loader/mode.py decides), or None."""
    if source.kind != "gguf":
        return None
    import gguf

    from llmserve.model.loader.mode import quantized_types, resolve_quantization

    types = quantized_types(gguf.GGUFReader(source.path))
    mode, _ = resolve_quantization("auto", gguf=True, block_types=types, device="cpu", vision=mc.mm_config is not None)
    return "/".join(types) if mode == "gguf" else None
