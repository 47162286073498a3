"""The model's configuration: `ModelConfig`, what a decoder is built from (sizes and per-architecture
features). llmserve.model.registry reads it from a checkpoint's transformers config (`config_from_hf`),
each family's features through its spec."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba-2 mixer's sizes (llmserve.model.layers.mamba2): `heads` heads of `head_dim` values
    (heads * head_dim = the inner width), B and C in `groups` groups of `state` values, a causal convolution
    `conv_kernel` wide over the inner values and B and C."""

    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 256  # the scan's chunk (the outputs do not depend on it)
    dt_min: float = 0.0  # time steps clamped to [dt_min, dt_max] after the softplus
    dt_max: float = float("inf")

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # the convolved channels: the inner values, then B, then C
        return self.inner + 2 * self.groups * self.state


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: object = None  # the transformers config, for rope variants
    # per-architecture features (defaults: Llama's)
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # the q / k norms span the whole projection, all heads together (OLMo 2)
    norm_offset: bool = False  # norms scale by (1 + weight) (Gemma: folded into the weight at load)
    embed_scale: float | None = None  # embeddings times sqrt(hidden) (Gemma), embedding_multiplier (Granite)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3, GLM-4, OLMo 2)
    pre_norms: bool = True  # norms before attention and the MLP (OLMo 2: none, only the sandwich's post-norms)
    rotary_interleaved: bool = False  # rotary pairs are adjacent dimensions (2i, 2i + 1) (GLM-4: layers.head_order)
    attn_scale: float | None = None  # None: head_dim ** -0.5; query_pre_attn_scalar ** -0.5 (Gemma), Granite's
    attn_softcap: float | None = None  # attention logits -> tanh(s / cap) * cap (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits (Gemma 2)
    residual_multiplier: float = 1.0  # attention and MLP outputs times this before the residual add (Granite)
    logits_scaling: float = 1.0  # the output logits divided by this (Granite)
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_tanh
    sliding_window: int | None = None  # the sliding layers attend to this many last positions
    sliding_layers: tuple[bool, ...] = ()  # per layer (empty: none)
    nope_layers: tuple[bool, ...] = ()  # per layer: no rotary at all (SmolLM3's NoPE layers; empty: none)
    num_experts: int = 0  # > 0: routed experts (llmserve.model.layers.moe) in the moe_layers
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    mamba: MambaConfig | None = None  # the Mamba-2 mixers' sizes (Granite 4.0-H: its recurrent_layers)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    router_bias: bool = False  # the MoE router has a bias (gpt-oss)
    router_topk_softmax: bool = False  # routing weights: a softmax over the top-k logits only (gpt-oss)
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    swiglu_alpha: float = 1.702  # hidden_act "clamped_swiglu" (gpt-oss): gate clamped above at swiglu_limit, up
    swiglu_limit: float = 7.0  # to +-swiglu_limit; (up + 1) * gate * sigmoid(alpha * gate)
    attn_sinks: bool = False  # a learned logit per query head joins each softmax's denominator (gpt-oss)
    o_proj_bias: bool = False  # the attention's output projection has a bias (gpt-oss)
    # multimodal rotary (M-RoPE, Qwen2.5-VL): each row has a (temporal, height, width) position, and the rotary
    # frequencies are split into these sections, each turned by one axis's position (empty: plain 1-D rotary)
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # the sections' frequencies interleaved t, h, w, t, h, w ... (Qwen3-VL)
    mm_config: object = None  # a vision-language model's whole transformers config (its tower's settings)
    # hybrid models: per layer, a recurrent mixer that keeps a state per sequence and no KV (empty: none)
    recurrent_layers: tuple[bool, ...] = ()
    conv_kernel: int = 0  # LFM2's short convolutions: their width (the state keeps the last width - 1 inputs)
    conv_bias: bool = False  # ... and whether their projections and the convolution have biases
    fused_decode: bool = True  # the family's layers are the fused C++ decode stack's (registry.ArchSpec.fused_decode)

    def matmul_flops_per_token(self) -> int:
        """FLOPs (2 per multiply-add) of one token through the decoder layers' projections: attention's q/k/v/o
        and the MLP, or the router and the active experts' share in MoE layers. What a prefill token costs, the LM
        head (run for sampled rows only) and the attention scores (which grow with the context) aside."""
        attn = self.hidden_size * self.head_dim * 2 * (self.num_heads + self.num_kv_heads)
        dense = 3 * self.hidden_size * self.intermediate_size
        moe = self.hidden_size * (self.num_experts + 3 * self.num_experts_per_tok * self.moe_intermediate_size)
        moe_layers = sum(self.moe_layers) if self.num_experts else 0
        return 2 * (self.num_layers * attn + (self.num_layers - moe_layers) * dense + moe_layers * moe)
