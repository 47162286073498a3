"""open_gguf's reader (plain-array slices over the file's memory map) reads what gguf's own GGUFReader reads."""

from __future__ import annotations

import numpy as np


def test_fast_reader_reads_what_gguf_reads(bundled_gguf):
    from gguf import GGUFReader

    from llmserve.model.loader.gguf import open_gguf

    ours, theirs = open_gguf(bundled_gguf), GGUFReader(bundled_gguf)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.parts, field.parts)), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.data_offset, a.n_bytes) == (
            b.tensor_type,
            list(b.shape),
            b.data_offset,
            b.n_bytes,
        )
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    # spot-check tensor bytes (all of them would read the whole file twice)
    for a, b in list(zip(ours.tensors, theirs.tensors))[:: max(1, len(ours.tensors) // 8)]:
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    # the vocabulary strings decode the same
    key = "tokenizer.ggml.tokens"
    assert ours.fields[key].contents() == theirs.fields[key].contents()
