"""Block names outside the process (kv_events.request_digests: the disk tier's file names, the published events)
follow the RAM prefix cache's identity: a block holding an image's placeholders is named by the picture too, so a
disk-tier file of one picture is never loaded for another with the same placeholder tokens."""

from __future__ import annotations

from llmserve.engine.kv_events import request_digests
from llmserve.engine.request import Request
from llmserve.model.vision.inputs import ImageInput
from llmserve.sampling_params import SamplingParams

BS = 16


def _request(rid: str, picture: str | None) -> Request:
    tokens = list(range(100, 100 + 4 * BS))  # four full blocks; placeholders at positions 20..39 (blocks 1, 2)
    r = Request(rid, tokens, SamplingParams(max_tokens=1))
    if picture is not None:
        r.images = [ImageInput(picture, list(range(20, 40)), {})]
    return r


def test_a_block_with_an_image_is_named_by_the_picture():
    a, b, same, text = (_request("a", "red"), _request("b", "blue"), _request("c", "red"), _request("d", None))
    da, db, dsame, dtext = (request_digests(r, BS, 4) for r in (a, b, same, text))
    assert da == dsame  # the same picture: the same names, a disk hit
    assert da[0] == db[0] == dtext[0]  # block 0 holds no placeholder: named by its tokens alone
    assert all(x != y for x, y in zip(da[1:], db[1:]))  # blocks 1, 2 hold the picture; block 3 chains on them
    assert all(x != y for x, y in zip(da[1:], dtext[1:]))
