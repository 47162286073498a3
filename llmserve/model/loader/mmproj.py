"""llama.cpp's projector files (`--mmproj FILE`, as llama-server names it): the vision tower and projector of a
vision-language model in a GGUF file of its own (`general.architecture` "clip", its settings under `clip.*`), beside
the text model's GGUF. The text file's config and the projector's become the Hugging Face vision-language config
(`vlm_config`), and the projector's tensors are read under the model's names (`MmprojTensors`), as llama.cpp's
converter names them: `v.patch_embd`, `v.position_embd`, `v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,
ffn_down}`, `v.post_ln`, and the family's projector (Idefics3: `mm.model.fc`; Gemma 3: `mm.input_projection`,
stored as Hugging Face's matrix, and `mm.soft_emb_norm`, stored as 1 + w). Qwen2.5-VL (`qwen2.5vl_merger`) and
Qwen3-VL (`qwen3vl_merger`) have towers of their own names: the Conv3d patch kernel split into its two frames
(`v.patch_embd.weight`, `.weight.1`), Qwen2.5-VL's q / k / v apart (Qwen3-VL's `attn_qkv` whole), the merger
`v.post_ln`, `mm.0`, `mm.2`, Qwen3-VL's `v.position_embd` and DeepStack mergers `v.deepstack.N.{norm,fc1,fc2}` (N the
tower block after which each runs). Tensors of any type the GGUF loader reads (F32, F16, Q8_0, ...) are dequantized to
float32 once, at load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# llama.cpp's names of a SigLIP tower's tensors (llmserve.model.vision.siglip) -> the tower's own
SIGLIP = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
}
SIGLIP_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
# Qwen2.5-VL's tower (llmserve.model.vision.qwen2_5_vl): q / k / v rows one after another in attn.qkv
QWEN25_TOWER = {
    "v.patch_embd": "patch_embed.proj",
    "v.post_ln": "merger.ln_q",
    "mm.0": "merger.mlp.0",
    "mm.2": "merger.mlp.2",
}
QWEN25_LAYER = {
    "attn_q": "attn.qkv",
    "attn_k": "attn.qkv",
    "attn_v": "attn.qkv",
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Qwen3-VL's (llmserve.model.vision.qwen3_vl)
QWEN3_TOWER = {
    "v.patch_embd": "patch_embed.proj",
    "v.position_embd": "pos_embed",
    "v.post_ln": "merger.norm",
    "mm.0": "merger.linear_fc1",
    "mm.2": "merger.linear_fc2",
}
QWEN3_LAYER = {
    "attn_qkv": "attn.qkv",
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_up": "mlp.linear_fc1",
    "ffn_down": "mlp.linear_fc2",
}
DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
QKV = ("attn_q", "attn_k", "attn_v")  # the order of a fused qkv's rows


@dataclass(frozen=True)
class Projector:
    """A `clip.projector_type` llmserve runs: the model it makes, where its tower sits, its projector's names."""

    architecture: str  # the Hugging Face class
    tower: str  # the tower's module in the model
    names: dict = field(default_factory=dict)  # the projector's tensors (llama.cpp's name -> the model's)
    norm_offset: tuple[str, ...] = ()  # tensors stored as 1 + w (read back as w, as the checkpoint holds them)
    text_arch: tuple[str, ...] = ()  # the text GGUF's general.architecture it goes with
    tower_names: dict = field(default_factory=lambda: dict(SIGLIP))  # llama.cpp's tower tensors -> the tower's
    layer_names: dict = field(default_factory=lambda: dict(SIGLIP_LAYER))  # v.blk.N.<key> -> <prefix>.N.<value>
    layers: str = "encoder.layers"  # the tower's blocks


PROJECTORS = {
    "idefics3": Projector(
        "Idefics3ForConditionalGeneration",
        "vision_model",
        {"mm.model.fc.weight": "connector.modality_projection.proj.weight"},
        text_arch=("llama",),
    ),
    "gemma3": Projector(
        "Gemma3ForConditionalGeneration",
        "vision_tower",
        {
            "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
            "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
        },
        norm_offset=("mm.soft_emb_norm.weight",),
        text_arch=("gemma3",),
    ),
    "qwen2.5vl_merger": Projector(
        "Qwen2_5_VLForConditionalGeneration",
        "visual",
        text_arch=("qwen2vl",),
        tower_names=QWEN25_TOWER,
        layer_names=QWEN25_LAYER,
        layers="blocks",
    ),
    "qwen3vl_merger": Projector(
        "Qwen3VLForConditionalGeneration",
        "visual",
        text_arch=("qwen3vl",),
        tower_names=QWEN3_TOWER,
        layer_names=QWEN3_LAYER,
        layers="blocks",
    ),
}
FAMILIES = "Idefics3 / SmolVLM, Gemma 3, Qwen2.5-VL, Qwen3-VL"


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def open_mmproj(path: str):
    """(the projector file's reader, its Projector); a ValueError naming the file for one llmserve cannot run."""
    from llmserve.model.loader.gguf import open_gguf

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    kind = _field(reader, "clip.projector_type") or _field(reader, "clip.vision.projector_type")
    if arch != "clip" or not _field(reader, "clip.has_vision_encoder", False):
        raise ValueError(f"mmproj: {path} is not a llama.cpp vision projector file (general.architecture {arch!r})")
    if kind not in PROJECTORS:
        raise ValueError(f"mmproj: {path} is a {kind!r} projector; llmserve runs {', '.join(PROJECTORS)} ({FAMILIES})")
    return reader, PROJECTORS[kind]


def vlm_config(text, text_reader, path: str):
    """The Hugging Face vision-language config of a text GGUF's config (`text`, loader.gguf.gguf_hf_config) and its
    projector file at `path`, with the image processor's settings the projector holds (`mmproj_processor`: the
    size, the tile size, mean and std; Qwen's pixel bounds) for llmserve.model.vision.processing."""
    reader, proj = open_mmproj(path)
    g = lambda key, default=None: _field(reader, f"clip.vision.{key}", default)  # noqa: E731
    text_arch = _field(text_reader, "general.architecture")
    if text_arch not in proj.text_arch:
        raise ValueError(
            f"mmproj: {path} is a projector for {proj.architecture}, whose text model is {'/'.join(proj.text_arch)}; "
            f"the model file is a {text_arch!r} one: a projector for another model"
        )
    if g("projection_dim") not in (None, text.hidden_size):
        raise ValueError(
            f"mmproj: {path} projects to {g('projection_dim')} values, the text model's width is {text.hidden_size}: "
            f"a projector for another model"
        )
    tokens = list(_field(text_reader, "tokenizer.ggml.tokens") or [])

    def token(name: str) -> int:
        if name not in tokens:
            raise ValueError(f"mmproj: the text model's vocabulary has no {name!r} token, which {path} needs")
        return tokens.index(name)

    make = _qwen_config if proj.text_arch[0] in ("qwen2vl", "qwen3vl") else _siglip_config
    cfg, processor = make(reader, g, proj, text, text_reader, token, path)
    cfg.architectures = [proj.architecture]
    cfg.mmproj_processor = dict(
        processor, image_mean=list(g("image_mean", [0.5] * 3)), image_std=list(g("image_std", [0.5] * 3))
    )
    cfg.mmproj_path = path
    return cfg


def _siglip_config(reader, g, proj, text, text_reader, token, path):
    """Idefics3 / SmolVLM, Gemma 3: a SigLIP tower (GELU-tanh) and the family's projector."""
    import transformers

    if not _field(reader, "clip.use_gelu", True):
        raise ValueError(f"mmproj: {path}: a tower without GELU is not supported")
    size, patch = g("image_size"), g("patch_size")
    vision = dict(
        hidden_size=g("embedding_length"),
        intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"),
        num_attention_heads=g("attention.head_count"),
        image_size=size,
        patch_size=patch,
        layer_norm_eps=g("attention.layer_norm_epsilon", 1e-6),
        hidden_act="gelu_pytorch_tanh",
    )
    if proj.architecture == "Idefics3ForConditionalGeneration":
        cfg = transformers.Idefics3Config(
            text_config=text.to_dict(),
            vision_config=vision,
            scale_factor=g("projector.scale_factor", 2),
            image_token_id=token("<image>"),
        )
        processor = dict(
            size={"longest_edge": g("preproc_image_size", size)},
            max_image_size={"longest_edge": size},
            do_image_splitting=True,
        )
        return cfg, processor
    per_side = size // patch // g("projector.scale_factor", 4)  # llama.cpp's default: 4x4 patches a soft token
    cfg = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=per_side * per_side,
        image_token_index=token("<image_soft_token>"),
        boi_token_index=token("<start_of_image>"),
        eoi_token_index=token("<end_of_image>"),
    )
    return cfg, dict(size={"height": size, "width": size})


# llama.cpp's bounds on a Qwen image's merge units (its defaults; a file may give image_min_pixels / max_pixels)
QWEN_MIN_UNITS, QWEN_MAX_UNITS = 8, 4096
QWEN_WINDOW = 112  # Qwen2.5-VL's attention window in pixels, llama.cpp's default where the file gives none


def _qwen_config(reader, g, proj, text, text_reader, token, path):
    """Qwen2.5-VL / Qwen3-VL: Qwen's tower (2x2 merge units, 2-frame patches) and the merger; Qwen2.5-VL's windows
    (full attention every n_wa_pattern-th block), Qwen3-VL's learned positions and DeepStack blocks."""
    import transformers

    depth, patch = g("block_count"), g("patch_size")
    merge = g("spatial_merge_size", 2)
    silu = _field(reader, "clip.use_silu", False)
    vision = dict(
        depth=depth,
        hidden_size=g("embedding_length"),
        intermediate_size=g("feed_forward_length"),
        num_heads=g("attention.head_count"),
        patch_size=patch,
        spatial_merge_size=merge,
        temporal_patch_size=2,  # (the converter writes the kernel's two frames, and takes no other)
        out_hidden_size=text.hidden_size,
        hidden_act="silu" if silu else "gelu_pytorch_tanh",
    )
    if proj.architecture == "Qwen2_5_VLForConditionalGeneration":
        every = g("n_wa_pattern", 0)  # full attention on blocks every-1, 2*every-1, ...; 0: on every block
        full = [i for i in range(depth) if not every or (i + 1) % every == 0]
        vision.update(window_size=g("window_size", QWEN_WINDOW), fullatt_block_indexes=full)
        cls = transformers.Qwen2_5_VLConfig
    else:
        deep = [i for i, on in enumerate(g("is_deepstack_layers") or []) if on]
        declared = _field(text_reader, "qwen3vl.n_deepstack_layers", len(deep))
        if declared != len(deep):
            raise ValueError(
                f"mmproj: {path} has {len(deep)} DeepStack blocks, the text model takes {declared}: "
                f"a projector for another model"
            )
        side = g("image_size") // patch
        vision.update(num_position_embeddings=side * side, deepstack_visual_indexes=deep)
        cls = transformers.Qwen3VLConfig
    cfg = cls(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=text.tie_word_embeddings,
    )
    unit = (patch * merge) ** 2
    processor = dict(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=2,
        size={
            "shortest_edge": g("image_min_pixels", QWEN_MIN_UNITS * unit),
            "longest_edge": g("image_max_pixels", QWEN_MAX_UNITS * unit),
        },
    )
    return cfg, processor


class MmprojTensors(Mapping):
    """A projector file's tensors under the model's names, float32 (dequantized from the file's type), each read when
    asked. A model tensor the converter split is joined back: Qwen2.5-VL's q / k / v rows (concatenated into qkv) and
    Qwen's patch kernel (its two frames, `v.patch_embd.weight` and `.weight.1`, stacked on the kernel's time axis)."""

    def __init__(self, path: str) -> None:
        self.reader, self.projector = open_mmproj(path)
        self.path = path
        deep = [i for i, on in enumerate(_field(self.reader, "clip.vision.is_deepstack_layers") or []) if on]
        self._deep = {str(layer): str(k) for k, layer in enumerate(deep)}
        parts: dict[str, list] = {}
        for t in self.reader.tensors:
            name = self._name(t.name)
            if name is not None:
                parts.setdefault(name, []).append(t)
        order = lambda t: (QKV.index(t.name.split(".")[3]) if t.name.split(".")[3] in QKV else 0, t.name)  # noqa: E731
        self._tensors = {
            n: sorted(ts, key=order) if n.endswith(("qkv.weight", "qkv.bias")) else sorted(ts, key=lambda t: t.name)
            for n, ts in parts.items()
        }

    def _name(self, gguf_name: str) -> str | None:
        p = self.projector
        if gguf_name in p.names:
            return p.names[gguf_name]
        if gguf_name == "v.patch_embd.weight.1":  # (Qwen: the patch kernel's second frame)
            gguf_name = "v.patch_embd.weight"
        stem, _, kind = gguf_name.rpartition(".")
        if stem in p.tower_names:
            return f"{p.tower}.{p.tower_names[stem]}.{kind}"
        parts = stem.split(".")  # v.blk.N.attn_q, v.deepstack.N.fc1
        if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in p.layer_names:
            return f"{p.tower}.{p.layers}.{parts[2]}.{p.layer_names[parts[3]]}.{kind}"
        if len(parts) == 4 and parts[:2] == ["v", "deepstack"] and parts[2] in self._deep and parts[3] in DEEPSTACK:
            return f"{p.tower}.deepstack_merger_list.{self._deep[parts[2]]}.{DEEPSTACK[parts[3]]}.{kind}"
        return None

    def _read(self, t) -> torch.Tensor:
        from llmserve.model.kernels import gguf_kernels

        raw, num, K = gguf_kernels.from_reader(t)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w = gguf_kernels.dequantize(raw, num, K).reshape(shape)
        return w - 1.0 if t.name in self.projector.norm_offset else w

    def __getitem__(self, name: str) -> torch.Tensor:
        ts = self._tensors[name]
        if len(ts) == 1:
            return self._read(ts[0])
        if ts[0].name.startswith("v.patch_embd."):  # [out, in, p, p] twice -> the Conv3d's [out, in, 2, p, p]
            return torch.stack([self._read(t) for t in ts], dim=2)
        return torch.cat([self._read(t) for t in ts])  # q, k, v rows

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def numel(self, name: str) -> int:
        return sum(int(t.n_elements) for t in self._tensors[name])
