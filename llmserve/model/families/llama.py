"""One decoder for the Llama family and its relatives: Llama (3.x rope scaling), SmolLM2, Mistral, Qwen2,
Qwen3, Phi-3 / Phi-4-mini, Granite 3.x, SmolLM3, Gemma 2 / Gemma 3 (text), and the mixture-of-experts Mixtral
and Qwen3-MoE, composed of llmserve.model.layers (attention, MLP or routed experts, norms, rotary); and its
weight packing.

Differences between them are configuration, read from the checkpoint's config into `ModelConfig`'s
feature fields (each family's: llmserve.model.registry): attention bias (Qwen2), tied or untied
embeddings, GQA, rope theta and scaling (partial rotary: q/k rows in layers.head_order), RMSNorm over
each q / k head (Qwen3, Gemma 3), Gemma's (1 + weight) norms, scaled embeddings, extra norms after
attention and the MLP, attention and final logit soft-capping, query_pre_attn_scalar, GELU-tanh MLP,
sliding-window layers, layers without rotary, routed experts. The model sees flat token batches and an
`AttentionMetadata`; it never sees a request. Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from llmserve.model.attention import AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.kernels import ops
from llmserve.model.layers import (
    MLP,
    Attention,
    Linear,
    RMSNorm,
    Rotary,
    SparseMoE,
    checkpoint_parts,
    head_order,
    head_rows,
    local_rope_parameters,
    qkv_in_head_order,
)
from llmserve.model.layers.cache_kinds import LayerKind


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0, max_positions: int | None = None) -> None:
        super().__init__()
        # a sliding layer attends to the last `sliding_window` positions: a mask in its attention (the engine's
        # window group gives its passed blocks back, engine/kv_window.py), only where a sequence can outgrow it
        self.sliding = bool(cfg.sliding_layers) and cfg.sliding_layers[index]
        self.nope = bool(cfg.nope_layers) and cfg.nope_layers[index]  # no rotary (SmolLM3)
        window = cfg.sliding_window if self.sliding and cfg.sliding_window < (max_positions or 1 << 62) else None
        # OLMo 2 has no norm before attention or the MLP (pre_norms False): only the sandwich's post-norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.pre_norms else None
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:  # Gemma, GLM-4, OLMo 2: post_attention_layernorm norms the attention's output
            if cfg.pre_norms:
                self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.moe_layers and cfg.moe_layers[index] else MLP(cfg)
        self.sandwich = cfg.sandwich_norms

    def cache_kind(self, kv_heads: int, kv_dtype: torch.dtype, state_dtype: torch.dtype) -> LayerKind:
        """What the layer keeps between steps (the KV plan's question: model/layers/cache_kinds.py)."""
        return self.self_attn.cache_kind(kv_heads, kv_dtype)

    def forward(self, x, residual, positions, rotary, kv_cache, meta):
        """x: the previous layer's output (the embeddings when residual is None); residual: the
        running sum of the outputs so far. Returns (this layer's output, the new running sum); the
        residual adds are fused with the norms that follow them."""
        if self.input_layernorm is None:  # OLMo 2: attention and the MLP read the running sum itself
            residual = x if residual is None else x + residual
            residual = residual + self.post_attention_layernorm(
                self.self_attn(residual, positions, rotary, kv_cache, meta)
            )
            return self.post_feedforward_layernorm(self.mlp(residual)), residual
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    layer_class = DecoderLayer  # (a family whose blocks are new has its own: granite_hybrid.HybridLayer)

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, max_positions) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.make_rotary(max_positions or cfg.max_position_embeddings)
        # the fused C++ decode stack knows Llama layers only (the family's spec says whether its layers are, see
        # llmserve.model.registry), with SiLU MLPs and no sliding window in effect: anything else takes the module path
        self._llama_layers = (
            cfg.fused_decode
            and cfg.hidden_act == "silu"
            and self.rotary_local is None
            and self.rotary_none is None
            and not any(layer.self_attn.window for layer in self.layers)
        )

    def make_rotary(self, max_positions: int, device: torch.device | None = None) -> None:
        """float32 cos/sin tables for `max_positions` (on `device`): one for every layer, a second for
        the sliding layers where the config has rope parameters per layer type (Gemma 3), and the identity
        for the layers without rotary (SmolLM3's NoPE layers)."""
        per_type = local_rope_parameters(self.cfg, "sliding_attention") is not None
        self.rotary = Rotary(self.cfg, max_positions, "full_attention" if per_type else None)
        self.rotary_local = Rotary(self.cfg, max_positions, "sliding_attention") if per_type else None
        self.rotary_none = Rotary.identity(self.cfg, max_positions) if any(self.cfg.nope_layers) else None
        if device is not None:
            self.rotary = self.rotary.to(device)
            self.rotary_local = self.rotary_local and self.rotary_local.to(device)
            self.rotary_none = self.rotary_none and self.rotary_none.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        argmax: bool = False,
        hidden_indices: torch.Tensor | None = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """Flat batch in, logits of the rows in `logits_indices` out ([len(logits_indices), vocab]);
        with `argmax`, those rows' greedy tokens instead ([len(logits_indices)], the same tokens as
        the logits' argmax: a float32 head is then screened rather than read whole, see ops.head_argmax).
        With `hidden_indices` (pooling requests: embeddings), (that, the final-normed hidden states of
        those rows). `embeds` (rows, values): those rows' input embeddings replaced (a vision tower's output at
        an image's placeholder tokens, llmserve.model.vision; values wider than the model: DeepStack rows beside
        them, added to the first layers' outputs at those rows, Qwen3-VL). `positions`: [T], or [3, T] under M-RoPE
        (`cfg.mrope_section`: a step with images of Qwen2.5-VL; layers.Rotary.multimodal)."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale is not None:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        deep = None  # DeepStack (Qwen3-VL): an image's rows for the first layers' outputs, beside its input rows
        if embeds is not None:
            rows, values = embeds
            if values.shape[1] > x.shape[1]:
                values = values.view(len(rows), -1, x.shape[1])
                values, deep = values[:, 0], values[:, 1:].to(x.dtype)
            x = x.index_copy(0, rows, values.to(x.dtype))
        residual = None
        main = self.rotary
        if positions.dim() == 2:  # M-RoPE: [3, T] (t, h, w) positions, a table of the step's own rows
            main, positions = self.rotary.multimodal(positions), torch.arange(positions.shape[1], device=x.device)
        first = kv_caches[0] if kv_caches else None  # (a recurrent layer's is a tuple of state tensors)
        fits = getattr(first, "dtype", None) in ops.KV_DTYPES and main is self.rotary
        stack = self._fused_decode(x, meta) if fits else None
        if stack is not None:  # decode rows only: all layers in one call into the CPU kernels
            g = meta.decode_groups[0]
            args = (x, kv_caches, positions, meta.slot_mapping, g.block_tables, g.context_lens)
            lora = self.lora_step.fused_args() if self.lora_step is not None else None
            x, residual = stack.run_lora(*args, *lora) if lora is not None else stack.run(*args)
        else:
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                rotary = self.rotary_local if layer.sliding and self.rotary_local is not None else main
                rotary = self.rotary_none if layer.nope else rotary
                x, residual = layer(x, residual, positions, rotary, kv, meta)
                if deep is not None and i < deep.shape[1]:  # (x + residual is the layer's output)
                    x = x.index_add(0, rows, deep[:, i])
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
        head, cap = self.lm_head, self.cfg.final_softcap
        if isinstance(head, nn.Linear) and head.bias is None:
            logits = ops.linear(x, head.weight, getattr(head, "packed", None)).float()
        else:
            logits = head(x).float()
        if self.cfg.logits_scaling != 1.0:  # (Granite: the argmax is the unscaled logits', see _head_argmax)
            logits = logits / self.cfg.logits_scaling
        return logits if cap is None else torch.tanh(logits / cap) * cap

    _screen = None  # (the head weight it was built from, its version, ops.head_screen's tensors)

    def _head_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        head = self.lm_head
        if not isinstance(head, nn.Linear) or head.bias is not None or self.cfg.final_softcap is not None:
            return None  # (soft-capped logits can tie where the raw ones do not: argmax of the capped ones)
        w = head.weight
        if x.dtype is not torch.float32 or w.dtype is not torch.float32 or w.is_cuda:
            return None
        if self._screen is None or self._screen[0] is not w or self._screen[1] != w._version:
            with torch.no_grad():
                self._screen = (w, w._version, ops.head_screen(w.detach()))
        return ops.head_argmax(x, w.detach(), self._screen[2])

    _decode_stack = None  # ops.decode_stack(self) once built, False where the model does not fit it
    # this step's LoRA adapter rows (llmserve.model.lora.LoRALayers, None: none): `fused_args()` gives
    # DecodeStack.run_lora's (segments, adapters), or None where the step must take the module path
    lora_step = None

    def _fused_decode(self, x: torch.Tensor, meta: AttentionMetadata):
        """The model's DecodeStack (every layer in one C++ call, see ops.decode_stack) when this step can use
        it: decode rows only, in one group, few rows, float32 on CPU with the kernels, no tensor
        parallelism, no biases, LoRA adapters only where the stack can apply them, Llama layers only; else None."""
        if (
            meta.prefills
            or len(meta.decode_groups) != 1
            or not self._llama_layers
            or (self.lora_step is not None and self.lora_step.fused_args() is None)
            or not ops.decode_stack_fits(x)
        ):
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
    def pack_weights(self) -> int:
        """Put the layers' float32 and int8 projections in oneDNN's layouts where ops.pack_weight says so, in place
        of the plain weight or beside it (after loading), and the head: an int8 one packed in place, a float32 one
        with a packed copy for sampled rows' logits (its plain weight may be the embedding, and greedy steps screen
        it: 16 sampled rows of a 1B model's tied head ~20 -> ~13 ms, for its bytes again). Returns how many."""
        packed = 0
        with torch.no_grad():
            for layer in self.layers:
                for lin in layer.modules():
                    if hasattr(lin, "pack_weight"):  # quantized (llmserve.model.formats.quant.QuantLinear)
                        packed += lin.pack_weight()
                    elif type(lin) is Linear:
                        w, replaces = ops.pack_weight(lin.weight)
                        if w is not None and replaces:
                            lin.weight = nn.Parameter(w, requires_grad=False)
                        elif w is not None:
                            lin.packed = w
                        packed += w is not None
            head = self.lm_head
            if hasattr(head, "pack_weight"):  # a quantized head (a grouped one: a per-channel copy for many rows)
                packed += head.pack_weight(grouped_copy=True)
            elif type(head) is Linear:  # float32: a packed copy for the sampled rows' logits, the plain weight kept
                head.packed = ops.pack_weight(head.weight)[0]
                packed += head.packed is not None
        self._decode_stack = None
        return packed

    def adapt_weight(self, layer: str, tensor: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """A checkpoint tensor (weight or bias) of the model's layer `layer` (`layers.0.self_attn.qkv_proj`) as the
        model holds it: q and k heads' rows in layers.head_order (partial rotary, `order`); o_proj and down_proj
        times the residual multiplier (Granite), so that the layers stay plain ones (the fused decode stack's).
        Also read by quant.quantize_model for the layers it rounds straight from the checkpoint."""
        if order is None:
            order = head_order(self.cfg)
        if order is not None and layer.endswith("self_attn.qkv_proj"):
            tensor = qkv_in_head_order(tensor, self.cfg, order)
        elif order is not None and layer.endswith(("self_attn.q_norm", "self_attn.k_norm")):
            tensor = head_rows(tensor, order, self.cfg.head_dim)
        if self.cfg.residual_multiplier != 1.0 and layer.endswith(("self_attn.o_proj", "mlp.down_proj")):
            tensor = tensor.float() * self.cfg.residual_multiplier
        return tensor

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...), packing as we go
        (PACKED_PROJECTIONS). Layers that already hold quantized weights (adopted from a GGUF file's
        blocks, see quant.quantize_model) have no float parameter to load and are skipped. A checkpoint
        that packs a projection itself (Phi-3's qkv_proj, gate_up_proj) is read as it is; Gemma's norm
        weights are stored as w - 1 and loaded as 1 + w. With partial rotary, q and k heads' rows (and their
        norms) are loaded in layers.head_order; Granite's residual multiplier is folded in (`adapt_weight`)."""
        keys = {k.removeprefix("model."): k for k in weights}  # `weights` may read each tensor when asked
        offset = self.cfg.norm_offset
        norms = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, RMSNorm)} if offset else ()
        order = head_order(self.cfg)
        for name, p in self.named_parameters():
            layer, _, kind = name.rpartition(".")
            if name == "lm_head.weight" and name not in keys:
                sources = ["embed_tokens.weight"]  # tied: the head reads the embedding
            elif name in keys:
                sources = [name]
            else:
                sources = [f"{part}.{kind}" for part in checkpoint_parts(layer)]
            missing = [n for n in sources if n not in keys]
            if missing:
                raise ValueError(f"model: checkpoint lacks weights for {missing[:5]}")
            tensor = weights[keys[sources[0]]] if len(sources) == 1 else torch.cat([weights[keys[n]] for n in sources])
            if p.shape != tensor.shape and [d for d in p.shape if d != 1] == [d for d in tensor.shape if d != 1]:
                tensor = tensor.reshape(p.shape)  # (unit dimensions only: a GGUF file's squeezed conv weight)
            if p.shape != tensor.shape:
                raise ValueError(f"model: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            if name in norms:
                tensor = 1.0 + tensor.float()
            tensor = self.adapt_weight(layer, tensor, order)
            with torch.no_grad():
                p.copy_(tensor)
        if (
            self.cfg.tie_word_embeddings
            and isinstance(self.lm_head, nn.Linear)
            and type(self.embed_tokens) is nn.Embedding
        ):
            self.lm_head.weight = self.embed_tokens.weight
