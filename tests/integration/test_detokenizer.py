"""Incremental detokenization: byte-correct UTF-8, stop strings across token boundaries."""

from __future__ import annotations

import pytest

from llmserve.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(bundled_gguf):
    return Tokenizer(bundled_gguf, gguf=True)


def stream(tok, text, stop=None, one_by_one=True):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [1], stop=stop)
    pieces = [d.add([i], finished=(k == len(ids) - 1)) for k, i in enumerate(ids)]
    return pieces, d


def test_multibyte_never_split(tok):
    text = "Grüße aus Köln! 你好，世界 🎉🎉 naïve café"
    pieces, d = stream(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # some character spans several tokens, so some steps had to emit nothing
    assert any(p == "" for p in pieces)


def test_stop_string_across_tokens(tok):
    text = "The answer is forty-two, and the question is unknown."
    pieces, d = stream(tok, text, stop=["forty-two"])
    assert d.stopped == "forty-two"
    assert "".join(pieces) == "The answer is "


def test_text_that_looks_like_a_stop_prefix_is_released(tok):
    text = "for the forest, for ever"
    pieces, d = stream(tok, text, stop=["forty"])
    assert d.stopped is None
    assert "".join(pieces) == text
