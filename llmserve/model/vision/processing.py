"""From decoded pictures to what the engine runs: each family's image processing (the tower's pixel inputs
and the placeholder run that stands for the image in the prompt), and `prompt_with_images`, which puts the
runs where the chat template wrote an image and finds each image's positions in the token ids.

Pillow-based throughout (transformers' *ImageProcessorPil classes): torchvision is not needed."""

from __future__ import annotations

import hashlib

from llmserve.model.vision.inputs import ImageInput, PromptWithImages


def content_hash(image) -> str:
    """The decoded picture's identity: its mode, size and pixels (a re-encoded copy of the same pixels hits)."""
    h = hashlib.sha256(f"{image.mode}:{image.size}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class ImageProcessing:
    """A family's image processing. `placeholder`: what the chat template writes for an image part (and the
    text a prompt may not hold); `image_token_id`: the token whose embeddings the tower's rows replace."""

    placeholder = "<image>"
    image_token = "<image>"  # the token the tower's rows replace (its id: image_token_id)
    image_token_id: int
    bidirectional = False  # an image's tokens attend to each other both ways (Gemma 3)

    def prepare(self, image) -> tuple[str, dict]:
        """(the image's placeholder run as prompt text, the tower's inputs)."""
        raise NotImplementedError

    def grid(self, data: dict) -> tuple[int, int, int] | None:
        """The image's tokens' (temporal, height, width) grid in the decoder (multimodal rotary); None: not used."""
        return None


def _hf_processor(name: str, source):
    """transformers' image processor `name`, from a checkpoint folder's preprocessor_config.json or (a dict) the
    settings a GGUF projector file holds."""
    import transformers

    cls = getattr(transformers, name)
    return cls(**source) if isinstance(source, dict) else cls.from_pretrained(source)


class Idefics3Processing(ImageProcessing):
    """Idefics3 / SmolVLM: the picture split into tiles of the tower's size (rows x cols, each tile
    `<fake_token_around_image><row_r_col_c>` and its image tokens, a newline after each row) and the whole
    picture scaled down as a last `<global-img>` tile, as the checkpoint's preprocessor_config.json says.
    SmolVLM (`smolvlm`) is the same with its own image processor class."""

    hf_processor_class = "Idefics3ImageProcessorPil"

    def __init__(self, source, hf) -> None:
        self.hf_processor = _hf_processor(self.hf_processor_class, source)
        vc = hf.vision_config
        self.seq_len = (vc.image_size // vc.patch_size) ** 2 // hf.scale_factor**2  # embedding rows per tile
        self.image_token_id = hf.image_token_id

    def prepare(self, image) -> tuple[str, dict]:
        out = self.hf_processor(images=[[image.convert("RGB")]], return_row_col_info=True, return_tensors="pt")
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        tile = "<image>" * self.seq_len
        if rows == 0 and cols == 0:  # not split: the whole picture alone
            text = f"<fake_token_around_image><global-img>{tile}<fake_token_around_image>"
        else:
            text = "".join(
                "".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
                for r in range(rows)
            )
            text += f"\n<fake_token_around_image><global-img>{tile}<fake_token_around_image>"
        return text, {"pixel_values": out["pixel_values"][0]}


class SmolVLMProcessing(Idefics3Processing):
    hf_processor_class = "SmolVLMImageProcessorPil"


class Gemma3Processing(ImageProcessing):
    """Gemma 3, pan and scan off: the picture resized to the tower's size; the template's `<start_of_image>`
    becomes blank lines, `<start_of_image>`, mm_tokens_per_image `<image_soft_token>`s, `<end_of_image>`."""

    placeholder = "<start_of_image>"
    image_token = "<image_soft_token>"
    bidirectional = True

    def __init__(self, source, hf) -> None:
        self.hf_processor = _hf_processor("Gemma3ImageProcessorPil", source)
        self.seq_len = hf.mm_tokens_per_image
        self.image_token_id = hf.image_token_index

    def prepare(self, image) -> tuple[str, dict]:
        out = self.hf_processor(images=[image.convert("RGB")], do_pan_and_scan=False, return_tensors="pt")
        run = f"\n\n{self.placeholder}{self.image_token * self.seq_len}<end_of_image>\n\n"
        return run, {"pixel_values": out["pixel_values"]}


class Qwen25VLProcessing(ImageProcessing):
    """Qwen2.5-VL: the picture resized by Qwen's rule (each side a multiple of patch_size x merge_size, the area
    within min_pixels..max_pixels, the aspect kept as well as that allows), rescaled and normalized, cut into
    patches (transformers' Pillow processor, Qwen2VLImageProcessorPil); the template's
    `<|vision_start|><|image_pad|><|vision_end|>` gets one `<|image_pad|>` per 2x2 merge unit of patches, and the
    image's grid (1, rows, cols of units) sets its multimodal rotary positions."""

    placeholder = "<|image_pad|>"
    image_token = "<|image_pad|>"

    def __init__(self, source, hf) -> None:
        self.hf_processor = _hf_processor("Qwen2VLImageProcessorPil", source)
        self.merge = hf.vision_config.spatial_merge_size
        self.image_token_id = hf.image_token_id

    def prepare(self, image) -> tuple[str, dict]:
        out = self.hf_processor(images=[image.convert("RGB")], return_tensors="pt")
        grid = out["image_grid_thw"][0]
        n = int(grid.prod()) // self.merge**2
        return self.image_token * n, {"pixel_values": out["pixel_values"], "image_grid_thw": grid}

    def grid(self, data: dict) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in data["image_grid_thw"])
        return t, h // self.merge, w // self.merge


def prompt_with_images(tokenizer, processing: ImageProcessing, text: str, images: list) -> PromptWithImages:
    """`text` (a rendered chat, one `processing.placeholder` per image, in order) with each placeholder
    replaced by its image's run, tokenized (the text holds its special tokens: none are added), and each
    image's positions: its image tokens, in order. ValueError if the placeholders and images differ in number."""
    parts = text.split(processing.placeholder)
    if len(parts) - 1 != len(images):
        raise ValueError(
            f"messages: the chat template wrote {len(parts) - 1} image placeholders for {len(images)} images"
        )
    runs = [processing.prepare(im) for im in images]
    full = parts[0] + "".join(run + rest for (run, _), rest in zip(runs, parts[1:]))
    ids = tokenizer.encode(full, add_special_tokens=False)
    at = [i for i, t in enumerate(ids) if t == processing.image_token_id]
    inputs, k = [], 0
    for (run, data), image in zip(runs, images):
        n = run.count(processing.image_token)
        both, grid = processing.bidirectional, processing.grid(data)
        inputs.append(ImageInput(content_hash(image), at[k : k + n], data, bidirectional=both, grid=grid))
        k += n
    if k != len(at):
        raise ValueError("messages: content must not contain image tokens")
    return PromptWithImages(ids, inputs)
