"""Qwen2.5-VL's inputs without a model: the image processing (Qwen's resize rule, rescale, normalize, patches in
2x2 merge units, each repeated in time) against a numpy reference written from the rule; the multimodal rotary
axes and a prompt's 3-D positions on small hand-checked cases."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmserve.model.layers.rotary import mrope_axes
from llmserve.model.vision.inputs import ImageInput, mrope_positions
from llmserve.model.vision.processing import Qwen25VLProcessing

MEAN = np.array([0.48145466, 0.4578275, 0.40821073])  # (OpenAI CLIP's, Qwen's default)
STD = np.array([0.26862954, 0.26130258, 0.27577711])


def _qwen_size(h: int, w: int, factor: int, least: int, most: int) -> tuple[int, int]:
    """Each side the nearest multiple of `factor`; the area scaled down (floor) above `most`, up (ceil) below
    `least`."""
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > most:
        s = math.sqrt(h * w / most)
        hb, wb = max(factor, math.floor(h / s / factor) * factor), max(factor, math.floor(w / s / factor) * factor)
    elif hb * wb < least:
        s = math.sqrt(least / (h * w))
        hb, wb = math.ceil(h * s / factor) * factor, math.ceil(w * s / factor) * factor
    return hb, wb


def _reference(image, patch: int, merge: int, least: int, most: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    from PIL import Image

    h, w = _qwen_size(image.height, image.width, patch * merge, least, most)
    x = np.asarray(image.convert("RGB").resize((w, h), Image.BICUBIC), dtype=np.float64) / 255.0
    x = ((x - MEAN) / STD).transpose(2, 0, 1)  # [C, H, W]
    gh, gw = h // patch, w // patch
    x = x.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.repeat(x[:, :, :, :, :, None], 2, axis=5)  # [units h, units w, m, m, C, time 2, P, P]
    return x.reshape(gh * gw, -1), (1, gh, gw)


@pytest.mark.parametrize("size", [(40, 50), (9, 30), (200, 120), (33, 33)])
def test_processing_equals_the_numpy_reference(size):
    from PIL import Image

    least, most = 64, 1024
    proc = Qwen25VLProcessing(
        dict(patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": least, "longest_edge": most}),
        SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2), image_token_id=7),
    )
    rng = np.random.default_rng(sum(size))
    image = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
    run, data = proc.prepare(image)
    want, grid = _reference(image, 4, 2, least, most)
    assert tuple(data["image_grid_thw"].tolist()) == grid
    assert least <= grid[1] * grid[2] * 16 <= most
    assert run == "<|image_pad|>" * (grid[1] * grid[2] // 4)
    assert proc.grid(data) == (1, grid[1] // 2, grid[2] // 2)
    np.testing.assert_allclose(data["pixel_values"].numpy(), want, atol=2e-5)


def _cfg(section, interleaved=False):
    return SimpleNamespace(head_dim=2 * sum(section), mrope_section=tuple(section), mrope_interleaved=interleaved)


def test_mrope_axes_consecutive_and_interleaved():
    assert mrope_axes(_cfg(())) is None
    assert mrope_axes(_cfg((1, 2, 2))).tolist() == [0, 1, 1, 2, 2] * 2
    # Qwen3-VL: h on 1, 4, ... below 3 * s1, w on 2, 5, ... below 3 * s2, t elsewhere
    assert mrope_axes(_cfg((3, 2, 2), interleaved=True)).tolist() == [0, 1, 2, 0, 1, 2, 0] * 2
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_axes(SimpleNamespace(head_dim=16, mrope_section=(2, 2, 2), mrope_interleaved=False))


def test_mrope_positions_of_a_prompt_with_two_images():
    # 2 text tokens, a 1x2x3 image (6 tokens), 1 text token, a 1x2x2 image (4), 2 text tokens
    a = ImageInput("a", list(range(2, 8)), {}, grid=(1, 2, 3))
    b = ImageInput("b", list(range(9, 13)), {}, grid=(1, 2, 2))
    pos, delta = mrope_positions(15, [a, b])
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert pos[:, 8].tolist() == [5, 5, 5]  # after the image: its start + max(h, w)
    assert pos[:, 9:13].tolist() == [[6] * 4, [6, 6, 7, 7], [6, 7, 6, 7]]
    assert pos[:, 13:].tolist() == [[8, 9]] * 3
    assert delta == 10 - 15  # token 15 (the first generated) at position 10
    with pytest.raises(ValueError, match="grid"):
        mrope_positions(15, [ImageInput("c", [2, 3], {})])


def test_multimodal_rotary_table_rows():
    """Rotary.multimodal: row i of the step's table is, per dimension, the shared table's row at that dimension's
    axis's position; with equal positions on all axes it is the plain row."""
    from llmserve.model.config import ModelConfig
    from llmserve.model.layers.rotary import Rotary

    cfg = ModelConfig(
        "Qwen2_5_VLForConditionalGeneration", 10, 16, 32, 1, 2, 1, 8, 1e-6, 10000.0, 64, False, mrope_section=(2, 1, 1)
    )
    rot = Rotary(cfg, 64)
    pos = torch.tensor([[3, 5, 7], [3, 9, 0], [3, 11, 2]])
    step = rot.multimodal(pos)
    assert torch.equal(step.cos[0], rot.cos[3]) and torch.equal(step.sin[0], rot.sin[3])
    for i in (1, 2):
        want = torch.cat([rot.cos[pos[0, i], :2], rot.cos[pos[1, i], 2:3], rot.cos[pos[2, i], 3:4]])
        assert torch.equal(step.cos[i], torch.cat([want, want]))
