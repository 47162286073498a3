"""The tensor-parallel step payload (engine/tp.py `_to`): moving it to a device keeps every field of the
attention metadata, the Gemma 3 image runs that attend both ways included."""

import torch

from llmserve.engine.tp import _to
from llmserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk


def test_moving_the_metadata_keeps_every_field():
    chunk = PrefillChunk(0, 5, 5, torch.tensor([3, 4]), bidirectional=((1, 4),))
    group = DecodeGroup(5, 6, torch.tensor([[7]]), torch.tensor([9]))
    meta = AttentionMetadata(torch.arange(6), [group], [chunk], window=AttentionMetadata(torch.arange(6), [], [chunk]))
    moved = _to(meta, torch.device("cpu"))
    assert moved.prefills[0].bidirectional == ((1, 4),)
    assert moved.window.prefills[0].bidirectional == ((1, 4),)
    assert (moved.prefills[0].query_start, moved.prefills[0].query_len, moved.prefills[0].context_len) == (0, 5, 5)
    assert torch.equal(moved.prefills[0].block_table, chunk.block_table)
    assert torch.equal(moved.decode_groups[0].context_lens, group.context_lens)
