"""The reasoning parser (--reasoning-parser): whole outputs, and the same outputs streamed in every split."""

from __future__ import annotations

import random

import pytest

from llmserve.server.reasoning import ReasoningParser

R1 = ReasoningParser.from_name("deepseek_r1")
QWEN = ReasoningParser.from_name("qwen3")

CASES = [  # text, (deepseek_r1 split), (qwen3 split)
    ("<think>\nLet me add.\n</think>\n\nIt is 4.", ("Let me add.\n", "It is 4."), ("Let me add.\n", "It is 4.")),
    ("Let me add.</think>It is 4.", ("Let me add.", "It is 4."), ("", "Let me add.</think>It is 4.")),
    ("It is 4.", ("It is 4.", ""), ("", "It is 4.")),
    ("<think>cut off while thinking", ("cut off while thinking", ""), ("cut off while thinking", "")),
    ("  <think>x</think>y", ("x", "y"), ("x", "y")),
    ("<thin", ("<thin", ""), ("", "<thin")),
    ("", ("", ""), ("", "")),
    ("<think></think>answer", ("", "answer"), ("", "answer")),
    ("a < b </thi nk> c</think>done", ("a < b </thi nk> c", "done"), ("", "a < b </thi nk> c</think>done")),
    ("<think>x</think>y</think>z", ("x", "y</think>z"), ("x", "y</think>z")),
]


def _streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    s = parser.stream()
    out = [s.feed(p) for p in pieces] + [s.flush()]
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


@pytest.mark.parametrize("text,r1,qwen", CASES)
def test_whole_outputs(text, r1, qwen):
    assert R1.split(text) == r1
    assert QWEN.split(text) == qwen


@pytest.mark.parametrize("text,r1,qwen", CASES)
def test_every_split_streams_the_same_pieces(text, r1, qwen):
    rng = random.Random(len(text))
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)]  # every 2-way split
    splits += [list(text)]  # a character at a time
    for _ in range(20):  # random cuts
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for parser, want in ((R1, r1), (QWEN, qwen)):
        for pieces in splits:
            reasoning, content, _ = _streamed(parser, pieces)
            assert (reasoning, content) == want, (parser, pieces)


def test_markers_are_never_sent_in_pieces():
    """A marker split across deltas is held back, not leaked as text before the split is known."""
    _, _, out = _streamed(QWEN, ["<th", "ink>abc</", "thi", "nk>", "answer"])
    assert out == [("", ""), ("abc", ""), ("", ""), ("", ""), ("", "answer"), ("", "")]


def test_custom_markers_and_bad_names():
    p = ReasoningParser.from_name("qwen3", "[THINK]", "[/THINK]")
    assert p.split("[THINK]plan[/THINK]do") == ("plan", "do")
    assert ReasoningParser.from_name(None) is None
    with pytest.raises(ValueError):
        ReasoningParser.from_name("nope")
    with pytest.raises(ValueError):
        ReasoningParser.from_name("qwen3", "<x>", "<x>")
