"""Random LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), written without
PEFT: for end-to-end tests and benchmarks on any model llmserve loads (tests/integration/test_lora.py checks
the format against PEFT itself)."""

from __future__ import annotations

import json
import os

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(
    path: str,
    model: str | None = None,
    rank: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    seed: int = 0,
    std: float = 0.05,
) -> str:
    """A random adapter for `model` (a path as `--model` takes it; default the bundled one) in folder
    `path`: lora_A and lora_B of `targets` in every layer, normal(0, std)."""
    import torch
    from safetensors.torch import save_file

    from llmserve.model.loader import load_model_config, resolve_model

    mc, _ = load_model_config(resolve_model(model))
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    h, inter = mc.hidden_size, mc.intermediate_size
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }  # (in, out)
    blocks = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(mc.num_layers):
        for t in targets:
            n_in, n_out = shapes[t]
            key = f"base_model.model.model.layers.{i}.{blocks.get(t, 'mlp')}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": alpha,
                "target_modules": list(targets),
                "bias": "none",
                "lora_dropout": 0.0,
                "task_type": "CAUSAL_LM",
            },
            f,
        )
    return path
