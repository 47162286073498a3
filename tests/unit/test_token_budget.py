"""The default step token budget (--max-num-batched-tokens left out): scaled to the model's cost per token on CPU."""

import dataclasses

from llmserve.engine.scheduler import default_token_budget
from llmserve.model.config import ModelConfig


def shape(hidden, inter, layers, heads, kv_heads, head_dim=64) -> ModelConfig:
    return ModelConfig(
        "LlamaForCausalLM", 49152, hidden, inter, layers, heads, kv_heads, head_dim, 1e-5, 1e4, 2048, True
    )


SMOLLM2_135M = shape(576, 1536, 30, 9, 3)
LLAMA_1B = shape(2048, 8192, 16, 32, 8)


def test_flops_per_token_counts_the_projections():
    # SmolLM2-135M: 106.2M parameters in its layers' projections, two FLOPs each
    assert SMOLLM2_135M.matmul_flops_per_token() == 2 * 30 * (576 * 64 * 2 * 12 + 3 * 576 * 1536)
    assert abs(LLAMA_1B.matmul_flops_per_token() / 1.947e9 - 1) < 0.01


def test_moe_counts_only_the_active_experts():
    moe = dataclasses.replace(
        LLAMA_1B, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8192, moe_layers=(True,) * 16
    )
    attn = 2048 * 64 * 2 * (32 + 8)
    # the router (8 logits) and two experts of the dense MLP's size in every layer
    assert moe.matmul_flops_per_token() == 2 * 16 * (attn + 2048 * 8 + 2 * 3 * 2048 * 8192)


def test_cpu_budget_follows_the_model_and_the_threads():
    small, big = SMOLLM2_135M.matmul_flops_per_token(), LLAMA_1B.matmul_flops_per_token()
    assert default_token_budget(small, "cpu", 2) == 512  # the bundled model keeps the old default
    assert default_token_budget(big, "cpu", 2) == 128  # 1B: smaller chunks, shorter steps
    assert default_token_budget(big, "cpu", 16) == 512  # eight times the threads: eight times the work per step
    assert default_token_budget(small, "cpu", 64) == 2048  # at most 2048
    assert default_token_budget(100 * big, "cpu", 2) == 128  # at least 128
    for threads in (1, 2, 3, 8):
        b = default_token_budget(big, "cpu", threads)
        assert b & (b - 1) == 0


def test_a_run_that_must_fit_one_step_raises_the_budget():
    big = LLAMA_1B.matmul_flops_per_token()
    assert default_token_budget(big, "cpu", 2, min_run=256) == 256  # Gemma 3's image: 256 tokens in one step
    assert default_token_budget(big, "cuda", 2) == 2048
