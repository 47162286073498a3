"""llama.cpp's projector files (`--mmproj FILE`, as llama-server names it): the vision tower and projector of a
vision-language model in a GGUF file of its own (`general.architecture` "clip", its settings under `clip.*`), beside
the text model's GGUF. The text file's config and the projector's become the Hugging Face vision-language config
(`vlm_config`), and the projector's tensors are read under the model's names (`MmprojTensors`), as llama.cpp's
converter names them: `v.patch_embd`, `v.position_embd`, `v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,
ffn_down}`, `v.post_ln`, and the family's projector (Idefics3: `mm.model.fc`; Gemma 3: `mm.input_projection`,
stored as Hugging Face's matrix, and `mm.soft_emb_norm`, stored as 1 + w)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# llama.cpp's names of a SigLIP tower's tensors (llmserve.model.vision.siglip) -> the tower's own
TOWER = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
}
TOWER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}


@dataclass(frozen=True)
class Projector:
    """A `clip.projector_type` llmserve runs: the model it makes, where its tower sits, its projector's names."""

    architecture: str  # the Hugging Face class
    tower: str  # the tower's module in the model
    names: dict = field(default_factory=dict)  # the projector's tensors (llama.cpp's name -> the model's)
    norm_offset: tuple[str, ...] = ()  # tensors stored as 1 + w (read back as w, as the checkpoint holds them)


PROJECTORS = {
    "idefics3": Projector(
        "Idefics3ForConditionalGeneration",
        "vision_model",
        {"mm.model.fc.weight": "connector.modality_projection.proj.weight"},
    ),
    "gemma3": Projector(
        "Gemma3ForConditionalGeneration",
        "vision_tower",
        {
            "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
            "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
        },
        norm_offset=("mm.soft_emb_norm.weight",),
    ),
}


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
        raise ValueError(
            f"mmproj: {path} is a {kind!r} projector; llmserve runs {', '.join(PROJECTORS)} (Idefics3 / SmolVLM, "
            f"Gemma 3)"
        )
    return reader, PROJECTORS[kind]


def vlm_config(text, text_reader, path: str):
    """The Hugging Face vision-language config of a text GGUF's config (`text`, loader.gguf.gguf_hf_config) and its
    projector file at `path`, with the image processor's settings the projector holds (`mmproj_processor`: the
    size, the tile size, mean and std) for llmserve.model.vision.processing."""
    import transformers

    reader, proj = open_mmproj(path)
    g = lambda key, default=None: _field(reader, f"clip.vision.{key}", default)  # noqa: E731
    if not _field(reader, "clip.use_gelu", True):
        raise ValueError(f"mmproj: {path}: a tower without GELU is not supported")
    if g("projection_dim") not in (None, text.hidden_size):
        raise ValueError(
            f"mmproj: {path} projects to {g('projection_dim')} values, the text model's width is {text.hidden_size}: "
            f"a projector for another model"
        )
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
    tokens = list(_field(text_reader, "tokenizer.ggml.tokens") or [])

    def token(name: str) -> int:
        if name not in tokens:
            raise ValueError(f"mmproj: the text model's vocabulary has no {name!r} token, which {path} needs")
        return tokens.index(name)

    mean, std = list(g("image_mean", [0.5] * 3)), list(g("image_std", [0.5] * 3))
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
            image_mean=mean,
            image_std=std,
        )
    else:
        per_side = size // patch // g("projector.scale_factor", 4)  # llama.cpp's default: 4x4 patches a soft token
        cfg = transformers.Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision,
            mm_tokens_per_image=per_side * per_side,
            image_token_index=token("<image_soft_token>"),
            boi_token_index=token("<start_of_image>"),
            eoi_token_index=token("<end_of_image>"),
        )
        processor = dict(size={"height": size, "width": size}, image_mean=mean, image_std=std)
    cfg.architectures = [proj.architecture]
    cfg.mmproj_processor = processor
    cfg.mmproj_path = path
    return cfg


class MmprojTensors(Mapping):
    """A projector file's tensors under the model's names, float32 (dequantized), each read when asked."""

    def __init__(self, path: str) -> None:
        self.reader, self.projector = open_mmproj(path)
        self.path = path
        self._tensors = {}
        for t in self.reader.tensors:
            name = self._name(t.name)
            if name is not None:
                self._tensors[name] = t

    def _name(self, gguf_name: str) -> str | None:
        p = self.projector
        if gguf_name in p.names:
            return p.names[gguf_name]
        stem, _, kind = gguf_name.rpartition(".")
        if stem in TOWER:
            return f"{p.tower}.{TOWER[stem]}.{kind}"
        parts = stem.split(".")  # v.blk.N.attn_q
        if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in TOWER_LAYER:
            return f"{p.tower}.encoder.layers.{parts[2]}.{TOWER_LAYER[parts[3]]}.{kind}"
        return None

    def __getitem__(self, name: str) -> torch.Tensor:
        from llmserve.model import gguf_kernels

        t = self._tensors[name]
        raw, num, K = gguf_kernels.from_reader(t)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w = gguf_kernels.dequantize(raw, num, K).reshape(shape)
        return w - 1.0 if t.name in self.projector.norm_offset else w

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def numel(self, name: str) -> int:
        return int(self._tensors[name].n_elements)
