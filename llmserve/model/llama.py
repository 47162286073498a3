"""One decoder for the Llama family: Llama, SmolLM2, Mistral, Qwen2.

Differences between them are configuration: attention bias (Qwen2), tied or untied embeddings, GQA,
rope theta and scaling. The model sees flat token batches and an `AttentionMetadata`; it never sees a
request. Q/K/V and gate/up projections are fused into one matmul each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from llmserve.model import ops
from llmserve.model.attention import AttentionMetadata, paged_attention

# llmserve's packed projections -> the checkpoint's (Hugging Face's) layers they are made of, in row order
PACKED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_parts(name: str) -> tuple[str, ...]:
    """The checkpoint layers behind one of this model's: `layers.0.mlp.gate_up_proj` ->
    (`layers.0.mlp.gate_proj`, `layers.0.mlp.up_proj`); any other name stands for itself."""
    prefix, dot, leaf = name.rpartition(".")
    return tuple(prefix + dot + part for part in PACKED_PROJECTIONS.get(leaf, (leaf,)))


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


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
    hf_config: object = None     # the transformers config, for rope variants

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and getattr(hf, "model_type", None) in SUPPORTED_ARCHITECTURES.values():
            arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[hf.model_type]
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs or getattr(hf, 'model_type', '?')}; "
                f"llmserve runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = hf.num_attention_heads
        rope = getattr(hf, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        scaling = getattr(hf, "rope_scaling", None) or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = hf.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or arch == "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rope_scaling=scaling,
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos,
            hf_config=hf,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in place where the fused kernel runs."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin table for every position up to max_positions, indexed by the batch's positions."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = self._inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    @staticmethod
    def _inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
        rope_type = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
        if rope_type != "default" and cfg.hf_config is not None:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"model: unsupported rope scaling {rope_type!r}")
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg.hf_config, "cpu")
            return inv_freq.float(), float(scale)
        d = cfg.head_dim
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)), 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)   # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5
        self.all_reduce = None   # tensor parallelism: sums the row-parallel o_proj partials

    def forward(self, x, positions, rotary: Rotary, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        written = ops.rotary_write_kv(qkv, positions, rotary.cos, rotary.sin, self.num_heads, self.num_kv_heads,
                                      self.head_dim, k_cache, v_cache, meta.slot_mapping)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if not written:
            q, k = rotary(q, k, positions)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, kv_written=written)
        o = self.o_proj(o.reshape(T, self.q_size))
        return o if self.all_reduce is None else self.all_reduce(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.all_reduce = None   # tensor parallelism: sums the row-parallel down_proj partials

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return o if self.all_reduce is None else self.all_reduce(o)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, rotary, kv_cache, meta):
        """x: the previous layer's output (the embeddings when residual is None); residual: the
        running sum of the outputs so far. Returns (this layer's output, the new running sum); the
        residual adds are fused with the norms that follow them."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata, logits_indices: torch.Tensor, argmax: bool = False,
                hidden_indices: torch.Tensor | None = None):
        """Flat batch in, logits of the rows in `logits_indices` out ([len(logits_indices), vocab]);
        with `argmax`, those rows' greedy tokens instead ([len(logits_indices)], the same tokens as
        the logits' argmax: a float32 head is then screened rather than read whole, see ops.head_argmax).
        With `hidden_indices` (pooling requests: embeddings), (that, the final-normed hidden states of
        those rows)."""
        x = self.embed_tokens(input_ids)
        residual = None
        stack = self._fused_decode(x, meta) if kv_caches and kv_caches[0].dtype in ops.KV_DTYPES else None
        if stack is not None:   # decode rows only: all layers in one call into the CPU kernels
            g = meta.decode_groups[0]
            x, residual = stack.run(x, kv_caches, positions, meta.slot_mapping, g.block_tables, g.context_lens)
        else:
            for layer, kv in zip(self.layers, kv_caches):
                x, residual = layer(x, residual, positions, self.rotary, kv, meta)
        hidden = None if hidden_indices is None else self.norm(x[hidden_indices] + residual[hidden_indices])
        x = self.norm(x[logits_indices] + residual[logits_indices])
        if argmax:
            tokens = self._head_argmax(x)
            out = tokens if tokens is not None else self.forward_head(x).argmax(dim=-1)
        else:
            out = self.forward_head(x)
        return out if hidden_indices is None else (out, hidden)

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """The final-normed rows' logits, float32."""
        head = self.lm_head
        if type(head) is nn.Linear and head.bias is None:
            return ops.linear(x, head.weight).float()
        return head(x).float()

    _screen = None   # (the head weight it was built from, its version, ops.head_screen's tensors)

    def _head_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        head = self.lm_head
        if type(head) is not nn.Linear or head.bias is not None:
            return None
        w = head.weight
        if x.dtype is not torch.float32 or w.dtype is not torch.float32 or w.is_cuda:
            return None
        if self._screen is None or self._screen[0] is not w or self._screen[1] != w._version:
            with torch.no_grad():
                self._screen = (w, w._version, ops.head_screen(w.detach()))
        return ops.head_argmax(x, w.detach(), self._screen[2])

    _decode_stack = None   # ops.decode_stack(self) once built, False where the model does not fit it
    lora_rows = False      # this step has LoRA adapter rows (llmserve.model.lora): the module path runs

    def _fused_decode(self, x: torch.Tensor, meta: AttentionMetadata):
        """The model's DecodeStack (every layer in one C++ call, see ops.decode_stack) when this step can use
        it: decode rows only, in one group, few rows, float32 on CPU with the kernels, no tensor
        parallelism, no biases, no LoRA rows; else None."""
        if meta.prefills or len(meta.decode_groups) != 1 or self.lora_rows or not ops.decode_stack_fits(x):
            return None
        if self._decode_stack is None:
            self._decode_stack = ops.decode_stack(self) or False
        return self._decode_stack or None

    def set_all_reduce(self, fn) -> None:
        """Tensor parallelism (llmserve.model.parallel): `fn(t) -> t` summed over the ranks, called
        after each row-parallel layer. None (the default) is a single-process model."""
        for layer in self.layers:
            layer.self_attn.all_reduce = fn
            layer.mlp.all_reduce = fn
        self._decode_stack = None

    # -- weights -------------------------------------------------------------------------------
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...), packing as we go
        (PACKED_PROJECTIONS). Layers that already hold quantized weights (adopted from a GGUF file's
        blocks, see quant.quantize_model) have no float parameter to load and are skipped."""
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        for name, p in self.named_parameters():
            layer, _, kind = name.rpartition(".")
            if name == "lm_head.weight" and name not in w:
                sources = ["embed_tokens.weight"]   # tied: the head reads the embedding
            else:
                sources = [f"{part}.{kind}" for part in checkpoint_parts(layer)]
            missing = [n for n in sources if n not in w]
            if missing:
                raise ValueError(f"model: checkpoint lacks weights for {missing[:5]}")
            tensor = w[sources[0]] if len(sources) == 1 else torch.cat([w[n] for n in sources])
            if p.shape != tensor.shape:
                raise ValueError(f"model: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
        if self.cfg.tie_word_embeddings and type(self.lm_head) is nn.Linear and type(self.embed_tokens) is nn.Embedding:
            self.lm_head.weight = self.embed_tokens.weight
