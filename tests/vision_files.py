"""A tiny random Idefics3 (SmolVLM) checkpoint for tests, written with transformers (no hub): the bundled
model's tokenizer with the image tokens added, a chat template that writes `<image>` for an image part, a
2-layer Llama decoder and a 2-layer SigLIP tower of 32x32 tiles (16 patches, 2x2 pixel shuffle: 4 embedding
rows a tile), images split into tiles of 32 up to 64 pixels a side. `pictures` are random PIL images."""

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
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def write_idefics3(folder, bundled_gguf: str, family: str = "Idefics3") -> None:
    """`family`: Idefics3 or SmolVLM (transformers' class-name prefix: the same model, its own classes)."""
    import transformers as T

    from llmserve.tokenizer import Tokenizer

    tok = Tokenizer(bundled_gguf, gguf=True).hf
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.chat_template = CHAT_TEMPLATE.replace("IMAGE", "<image>")
    text = dict(
        model_type="llama",
        vocab_size=len(tok),
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
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32)
    cfg = getattr(T, f"{family}Config")(
        text_config=text,
        vision_config=dict(vision, patch_size=8),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    model = getattr(T, f"{family}ForConditionalGeneration")(cfg)
    with torch.no_grad():  # norms away from 1 and a tower loud enough that its output moves the decoder
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "vision" in name or "connector" in name:
                p.mul_(5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    getattr(T, f"{family}ImageProcessorPil")(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    ).save_pretrained(folder)


def write_gemma3(folder, bundled_gguf: str) -> None:
    """Gemma 3 with a SigLIP tower of 32x32 pictures (16 patches pooled to 4 soft tokens), a sliding layer whose
    window is shorter than the prompts and a global one."""
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
            query_pre_attn_scalar=24,
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


def pictures(n: int, seed: int = 0, size: tuple[int, int] = (40, 50)) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)) for _ in range(n)]
