"""An image as the engine carries it: where its placeholder tokens sit in the prompt, its content hash (for
the prefix cache), the vision tower's inputs, and the tower's output once computed (kept for the request's
lifetime: a chunked or preempted prefill slices it again rather than running the tower twice)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class ImageInput:
    content_hash: str  # sha256 of the decoded pixels: the same picture hits the prefix cache, another never
    positions: list[int]  # prompt positions (ascending) whose embeddings are the tower's output rows, in order
    data: dict = field(repr=False)  # the tower's inputs (pixel tensors), its family's own keys
    embeds: torch.Tensor | None = field(default=None, repr=False)  # [len(positions), hidden] once computed
    # its placeholders attend to each other both ways in the decoder (Gemma 3): a prefill chunk never ends inside
    # them (Scheduler), and the chunk's attention lets them see the whole run (PrefillChunk.bidirectional)
    bidirectional: bool = False
    # its tokens' (temporal, height, width) grid in the decoder, under multimodal rotary (Qwen2.5-VL: mrope_positions)
    grid: tuple[int, int, int] | None = None

    @property
    def start(self) -> int:
        return self.positions[0]

    @property
    def end(self) -> int:
        """One past its last placeholder."""
        return self.positions[-1] + 1

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


class PromptWithImages(list):
    """Prompt token ids that carry the images their placeholders stand for (`images`, in prompt order). It
    is a list of ints everywhere a prompt is one (lengths, admission, logging); the engine reads `images`."""

    def __init__(self, ids, images: list[ImageInput]) -> None:
        super().__init__(ids)
        self.images = list(images)


def whole_images(images: list[ImageInput], start: int, num_new: int, budget: int) -> int:
    """How many of the `num_new` tokens from position `start` to schedule so that no chunk ends inside a
    bidirectional image's run: cut back to just before a run it would split, or (a chunk that starts at or inside a
    run) grown to the run's end where `budget` allows; 0: the run does not fit this step."""
    end = start + num_new
    for im in images:
        if im.bidirectional and im.start < end < im.end:
            end = im.start if im.start > start else (im.end if im.end - start <= budget else start)
    return end - start


def prompt_images(prompt) -> list[ImageInput]:
    """The images a prompt carries ([] for a plain list of ids or a string)."""
    return list(getattr(prompt, "images", None) or ())


def mrope_positions(num_tokens: int, images: list[ImageInput]) -> tuple[torch.Tensor, int]:
    """A prompt's multimodal rotary positions (M-RoPE, Qwen2.5-VL): [3, num_tokens] (temporal, height, width).
    Text takes one position on all three axes, counting on from the last; an image's tokens (its `grid`, t x h x w
    in row-major order) take start + their grid coordinates, and the text after it starts at start + max(h, w)
    (as transformers' get_rope_index). Also the offset of the tokens after the prompt: token i's position is
    i + delta on every axis (delta <= 0: an image takes fewer positions than tokens)."""
    rows, at, nxt = [], 0, 0  # the next token index and the next text position
    for im in images:
        if im.grid is None or im.num_tokens != im.end - im.start:
            raise ValueError("multimodal rotary needs each image's grid and one run of its tokens")
        rows.append(torch.arange(nxt, nxt + im.start - at).expand(3, -1))
        nxt += im.start - at
        t, h, w = im.grid
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(torch.stack(grid).reshape(3, -1) + nxt)
        nxt += max(h, w)
        at = im.end
    rows.append(torch.arange(nxt, nxt + num_tokens - at).expand(3, -1))
    pos = torch.cat(rows, dim=1)
    return pos, int(pos.max()) + 1 - num_tokens
