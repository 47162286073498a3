"""Tiny random vision-language checkpoints for tests, written with transformers (no hub): the bundled model's
tokenizer with the family's image tokens added, a chat template that writes the family's placeholder for an image
part, and a 2-layer decoder. Idefics3 / SmolVLM: a 2-layer SigLIP tower of 32x32 tiles (16 patches, 2x2 pixel
shuffle: 4 embedding rows a tile), images split into tiles of 32 up to 64 pixels a side; Gemma 3 and Qwen2.5-VL:
see theirs. `pictures` are random PIL images."""

from __future__ import annotations

import numpy as np
import torch

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
# ChatML, with content given as parts: text as it is, an image part as IMAGE (the family's placeholder)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the decoder of the tiny checkpoints (Idefics3 / SmolVLM, Qwen2.5-VL / Qwen3-VL)
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    max_position_embeddings=512,
)
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


# the tiny Idefics3 / SmolVLM shapes (write_idefics3's default): decoder overrides, tower, pixel shuffle, resize target
# and tile side of the image processor, and whether the tower's weights are made loud
TINY_IDEFICS3 = dict(
    text={},
    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32),
    patch_size=8,
    scale_factor=2,
    longest_edge=64,
    loud=True,
)


def write_idefics3(folder, bundled_gguf: str, family: str = "Idefics3", shapes: dict = TINY_IDEFICS3) -> None:
    """`family`: Idefics3 or SmolVLM (transformers' class-name prefix: the same model, its own classes). `shapes`:
    TINY_IDEFICS3's keys (benchmarks/serving/vision_peers.py writes SmolVLM-256M's)."""
    import transformers as T

    from llmserve.tokenizer import Tokenizer

    tok = Tokenizer(bundled_gguf, gguf=True).hf
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.chat_template = CHAT_TEMPLATE.replace("IMAGE", "<image>")
    text = dict(TINY_DECODER, model_type="llama", vocab_size=len(tok), **shapes["text"])
    vision = shapes["vision"]
    cfg = getattr(T, f"{family}Config")(
        text_config=text,
        vision_config=dict(vision, patch_size=shapes["patch_size"]),
        scale_factor=shapes["scale_factor"],
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    model = getattr(T, f"{family}ForConditionalGeneration")(cfg)
    with torch.no_grad():  # norms away from 1 and a tower loud enough that its output moves the decoder
        for name, p in model.named_parameters():
            if not shapes["loud"]:
                break
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "vision" in name or "connector" in name:
                p.mul_(5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    getattr(T, f"{family}ImageProcessorPil")(
        size={"longest_edge": shapes["longest_edge"]},
        max_image_size={"longest_edge": vision["image_size"]},
        do_image_splitting=True,
    ).save_pretrained(folder)


def write_gemma3(folder, bundled_gguf: str, query_pre_attn_scalar: int = 24) -> None:
    """Gemma 3 with a SigLIP tower of 32x32 pictures (16 patches pooled to 4 soft tokens), a sliding layer whose
    window is shorter than the prompts and a global one. (`query_pre_attn_scalar`: 16, the head size, is what a
    GGUF file of it gives: llama.cpp stores none and scales by the head size.)"""
    import json

    import transformers as T

    from llmserve.tokenizer import Tokenizer

    tok = Tokenizer(bundled_gguf, gguf=True).hf
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    tok.chat_template = CHAT_TEMPLATE.replace("IMAGE", "<start_of_image>")
    tok.save_pretrained(folder)
    path = folder / "tokenizer_config.json"  # the token roles transformers' Gemma3Processor reads
    path.write_text(json.dumps({**json.loads(path.read_text()), "extra_special_tokens": GEMMA3_TOKENS}))
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
    cfg = T.Gemma3Config(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=24,
            query_pre_attn_scalar=query_pre_attn_scalar,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
        image_token_index=ids["image_token"],
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
    )
    torch.manual_seed(0)
    model = T.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif "vision" in name or "projector" in name:
                p.normal_(0.0, 0.5) if "projection" in name else p.mul_(5)
    model.save_pretrained(folder)
    T.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)


QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def write_qwen_vl(folder, bundled_gguf: str, family: str = "Qwen2_5_VL", depth: int = 2) -> None:
    """Qwen2.5-VL (`family` Qwen2_5_VL) or Qwen3-VL (Qwen3VL) with a 2-block tower of 4-pixel patches in 2x2 merge
    units and Qwen's resize to 64..1024 pixels (a 40x50 picture: 24x32, 3x4 units, 12 tokens), multimodal rotary
    sections [2, 3, 3] over 16-wide heads. Qwen2.5-VL: windows of 2x2 units on block 0, the whole image on block 1;
    Qwen3-VL: a 4x4 learned position table, DeepStack rows from block 0 (added after the decoder's layer 0). (`depth`:
    llama.cpp's converter maps the merger's `mlp.2` only for a tower of 3 blocks or more.)"""
    import transformers as T

    from llmserve.tokenizer import Tokenizer

    tok = Tokenizer(bundled_gguf, gguf=True).hf
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    tok.chat_template = CHAT_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
    tok.save_pretrained(folder)
    ids = dict(zip(QWEN_TOKENS, tok.convert_tokens_to_ids(QWEN_TOKENS)))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, out_hidden_size=64)
    if family == "Qwen3VL":
        rope["mrope_interleaved"] = True
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    else:
        vision.update(window_size=16, fullatt_block_indexes=[1])
    cfg = getattr(T, f"{family}Config")(
        text_config=dict(TINY_DECODER, vocab_size=len(tok), head_dim=16, rope_parameters=rope),
        vision_config=dict(vision, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = getattr(T, f"{family}ForConditionalGeneration")(cfg)
    with torch.no_grad():  # norms away from 1 and a tower loud enough that its output moves the decoder
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.3)
            elif "visual" in name or name.endswith("bias"):  # (Qwen2.5-VL's q/k/v biases too)
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    T.Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 64, "longest_edge": 1024}
    ).save_pretrained(folder)


def qwen_processor(image_processor, tok):
    """Qwen2.5-VL / Qwen3-VL's processor as transformers' does it for images: each `<|image_pad|>` repeated once per
    2x2 merge unit of its image's patch grid (transformers' image processor), the token types marking them."""

    def process(text, images=None, **_):
        text = text[0]
        enc = {}
        if images:
            pix = image_processor(images=images[0], return_tensors="pt")
            runs = (int(g.prod()) // 4 for g in pix["image_grid_thw"])
            parts = text.split("<|image_pad|>")
            text = parts[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(runs, parts[1:]))
            enc = dict(pix)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        kinds = (ids == tok.convert_tokens_to_ids("<|image_pad|>")).int()
        return {**enc, "input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": kinds}

    return process


def pictures(n: int, seed: int = 0, size: tuple[int, int] = (40, 50)) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)) for _ in range(n)]


# checkpoint names of the decoder -> a plain text model's (llama.cpp's converter writes the decoder alone)
_TEXT_NAMES = (
    ("model.text_model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def write_vlm_ggufs(
    folder, text_path: str, mmproj_path: str, projector_type: str = "F32", dequantized: bool = False
) -> tuple[str, str]:
    """The tiny checkpoint in `folder` (write_idefics3 / write_gemma3 / write_qwen_vl) as llama.cpp's converter writes
    a vision-language model, independently of llmserve's reading of it: a text GGUF (the decoder, tests/gguf_files.py's
    writer; the bundled tokenizer with the checkpoint's added tokens as control tokens, and its chat template; Qwen's
    qwen2vl / qwen3vl with the rotary sections as rope.dimension_sections) and a projector GGUF (`--mmproj`:
    general.architecture clip, the tower and projector under the converter's names, clip.* settings from the config and
    preprocessor_config.json, Gemma 3's soft_emb_norm as 1 + w; Qwen's patch kernel split into its two frames and
    Qwen2.5-VL's q / k / v apart). `projector_type` F32, F16 or Q8_0 (`--outtype`): the weight matrices in that type,
    norms, biases, the patch kernel and position table float32, as the converter keeps them; `dequantized`: a float32
    file of the Q8_0 values instead (gguf's own dequantization)."""
    import json
    import os

    import transformers as T
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants
    from safetensors.numpy import load_file

    from tests.gguf_files import small_tokenizer_fields, write_gguf

    full = T.AutoConfig.from_pretrained(folder)
    kind = full.model_type  # idefics3 / smolvlm, gemma3, qwen2_5_vl, qwen3_vl
    text_cfg = full.get_text_config().to_dict()
    text, vision = {}, {}
    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        plain = name
        for old, new in _TEXT_NAMES:
            plain = plain.replace(old, new)
        if plain.startswith("model.layers.") or plain in (
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
        ):
            text[plain] = t
        else:
            vision[name.removeprefix("model.")] = t
    tok = T.AutoTokenizer.from_pretrained(folder)
    fields = small_tokenizer_fields(text_cfg["vocab_size"])
    (tokens, ttypes), (kinds, ktypes) = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    added = tok.convert_ids_to_tokens(list(range(len(tokens), len(tok))))
    fields["tokenizer.ggml.tokens"] = (list(tokens) + added, ttypes)
    fields["tokenizer.ggml.token_type"] = (list(kinds) + [3] * len(added), ktypes)  # 3: CONTROL
    fields["tokenizer.chat_template"] = (tok.chat_template, [GGUFValueType.STRING])

    def text_extra(w) -> None:
        if kind == "gemma3":  # which layers slide (llama.cpp's default is five of every six)
            pattern = [t == "sliding_attention" for t in text_cfg["layer_types"]]
            w.add_key_value("gemma3.attention.sliding_window_pattern", pattern, GGUFValueType.ARRAY, GGUFValueType.BOOL)
        if kind.startswith("qwen"):  # the converter pads the t, h, w sections to four
            w.add_rope_dimension_sections(list(text_cfg["rope_parameters"]["mrope_section"]) + [0])
        if kind == "qwen3_vl":
            w.add_num_deepstack_layers(len(full.vision_config.deepstack_visual_indexes))

    arch = {"gemma3": "gemma3", "qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl"}.get(kind, "llama")
    write_gguf(text_path, arch, text_cfg, text, fields, extra=text_extra)

    pre = json.load(open(os.path.join(folder, "preprocessor_config.json")))
    w = GGUFWriter(mmproj_path, "clip")
    w.add_type("mmproj")
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(text_cfg["hidden_size"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    writer = _qwen_projector if kind.startswith("qwen") else _siglip_projector
    tensors = writer(w, full, pre, vision, text_cfg)
    for name, t in tensors.items():
        t = t.astype(np.float32)
        keep = t.ndim <= 1 or "_norm." in name or ".position_embd." in name or ".patch_embd." in name
        if projector_type == "F32" or keep:
            w.add_tensor(name, t)
            continue
        qtype = GGMLQuantizationType[projector_type]
        if qtype == GGMLQuantizationType.Q8_0 and t.shape[-1] % 32:
            qtype = GGMLQuantizationType.F16  # (the converter's fallback)
        if qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, t.astype(np.float16).astype(np.float32) if dequantized else t.astype(np.float16))
            continue
        q = quants.quantize(t, qtype)
        if dequantized:
            w.add_tensor(name, quants.dequantize(q, qtype).reshape(t.shape).astype(np.float32))
        else:
            w.add_tensor(name, q, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return text_path, mmproj_path


def _siglip_projector(w, full, pre, vision: dict, text_cfg: dict) -> dict:
    """Idefics3 / SmolVLM and Gemma 3's clip.* settings (written into `w`) and tensors, by the converter's names."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    gemma, vc = full.model_type == "gemma3", full.vision_config
    w.add_clip_projector_type("gemma3" if gemma else "idefics3")
    w.add_vision_image_size(vc.image_size)
    w.add_vision_patch_size(vc.patch_size)
    w.add_vision_embedding_length(vc.hidden_size)
    w.add_vision_feed_forward_length(vc.intermediate_size)
    w.add_vision_block_count(vc.num_hidden_layers)
    w.add_vision_head_count(vc.num_attention_heads)
    w.add_vision_attention_layernorm_eps(vc.layer_norm_eps)
    w.add_vision_use_gelu(True)
    if gemma:  # patches pooled into one soft token, a side (written where it is not llama.cpp's default 4)
        w.add_vision_projector_scale_factor(vc.image_size // vc.patch_size // int(round(full.mm_tokens_per_image**0.5)))
    else:
        w.add_vision_projector_scale_factor(full.scale_factor)
        w.add_vision_preproc_image_size(pre["size"]["longest_edge"])
    names, out = get_tensor_name_map(MODEL_ARCH.MMPROJ, vc.num_hidden_layers), {}
    for name, t in vision.items():
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)  # (the hub checkpoints' names)
        if ".vision_model.head." in name:  # SigLIP's pooling head: unused, the converter skips it
            continue
        if name.endswith("_weight"):  # Gemma 3's mm_input_projection_weight, as the converter renames it
            name = name.removesuffix("_weight") + ".weight"
        if "soft_emb_norm" in name:  # Gemma's 1 + w, stored as llama.cpp computes with it
            t = t + 1
        suffixes = (".weight", ".bias")
        new = names.get_name(name, try_suffixes=suffixes) or names.get_name("model." + name, try_suffixes=suffixes)
        assert new is not None, name
        out[new] = t
    return out


def _qwen_projector(w, full, pre, vision: dict, text_cfg: dict) -> dict:
    """Qwen2.5-VL (qwen2.5vl_merger) and Qwen3-VL (qwen3vl_merger): the converter's clip.* settings and tensor names.
    The converter writes neither Qwen2.5-VL's window nor the processor's pixel bounds (llama.cpp takes a 112-pixel
    window and 8..4096 merge units); this writes them as clip.vision.window_size and image_min_pixels /
    image_max_pixels (keys llama.cpp reads for other projectors), as the tiny checkpoint's differ."""
    vc, qwen3 = full.vision_config, full.model_type == "qwen3_vl"
    w.add_clip_projector_type("qwen3vl_merger" if qwen3 else "qwen2.5vl_merger")
    side = int(vc.num_position_embeddings**0.5) if qwen3 else 560 // vc.patch_size  # (Qwen2.5-VL: the converter's 560)
    w.add_vision_image_size(side * vc.patch_size)
    w.add_vision_patch_size(vc.patch_size)
    w.add_vision_embedding_length(vc.hidden_size)
    w.add_vision_feed_forward_length(vc.intermediate_size)
    w.add_vision_block_count(vc.depth)
    w.add_vision_head_count(vc.num_heads)
    w.add_vision_attention_layernorm_eps(text_cfg.get("rms_norm_eps", 1e-6))
    w.add_uint32("clip.vision.image_min_pixels", pre["size"]["shortest_edge"])
    w.add_uint32("clip.vision.image_max_pixels", pre["size"]["longest_edge"])
    if qwen3:
        w.add_vision_use_gelu(True)
        w.add_vision_spatial_merge_size(vc.spatial_merge_size)
        w.add_vision_is_deepstack_layers([i in vc.deepstack_visual_indexes for i in range(vc.depth)])
    else:
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(vc.fullatt_block_indexes[0] + 1)
        w.add_vision_window_size(vc.window_size)
    layer = {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "attn.qkv": "attn_qkv"}
    layer.update({f"mlp.{k}": f"ffn_{v}" for k, v in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))})
    layer.update({"mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"})
    merger = {"ln_q": "v.post_ln", "norm": "v.post_ln", "mlp.0": "mm.0", "linear_fc1": "mm.0"}
    merger.update({"mlp.2": "mm.2", "linear_fc2": "mm.2"})
    out = {}
    for name, t in vision.items():
        stem, _, kind = name.rpartition(".")
        parts = stem.split(".")
        if stem == "visual.patch_embed.proj" and kind == "weight":  # Conv3d [out, in, 2, p, p] -> two Conv2d kernels
            out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = t[:, :, 0], t[:, :, 1]
        elif stem == "visual.patch_embed.proj":
            out[f"v.patch_embd.{kind}"] = t
        elif stem == "visual.pos_embed":
            out[f"v.position_embd.{kind}"] = t
        elif parts[:2] == ["visual", "merger"]:
            out[f"{merger['.'.join(parts[2:])]}.{kind}"] = t
        elif parts[:2] == ["visual", "deepstack_merger_list"]:  # by the tower block it follows
            block = vc.deepstack_visual_indexes[int(parts[2])]
            out[f"v.deepstack.{block}.{parts[3].removeprefix('linear_')}.{kind}"] = t
        elif parts[:2] == ["visual", "blocks"]:
            key = layer[".".join(parts[3:])]
            if key == "attn_qkv" and not qwen3:  # Qwen2.5-VL: the converter splits q, k, v
                for part, rows in zip(("attn_q", "attn_k", "attn_v"), np.split(t, 3)):
                    out[f"v.blk.{parts[2]}.{part}.{kind}"] = rows
            else:
                out[f"v.blk.{parts[2]}.{key}.{kind}"] = t
        else:
            raise AssertionError(name)
    return out
