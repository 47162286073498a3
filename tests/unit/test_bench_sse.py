"""The bench's SSE parser: any split of the byte stream gives the same events."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.bench.sse import SSEParser

STREAM = (
    ": connected\n\n"
    'data: {"choices":[{"delta":{"content":"Grüße "}}]}\n\n'
    ": ping\n\n"
    'data: {"choices":[{"delta":{"content":"日本語 🚀"}}]}\r\n\r\n'
    'event: message\ndata: {"a":1}\rdata: {"b":2}\r\r'
    "id: 7\nretry: 100\ndata:no-space\n\n"
    "data: [DONE]\n\n"
).encode("utf-8")

EXPECTED = [
    '{"choices":[{"delta":{"content":"Grüße "}}]}',
    '{"choices":[{"delta":{"content":"日本語 🚀"}}]}',
    '{"a":1}\n{"b":2}',
    "no-space",
    "[DONE]",
]


def parse(pieces: list[bytes]) -> tuple[list[str], SSEParser]:
    parser, out = SSEParser(), []
    for piece in pieces:
        out += [e.data for e in parser.feed(piece)]
    out += [e.data for e in parser.close()]
    return out, parser


def test_whole_stream():
    events, parser = parse([STREAM])
    assert events == EXPECTED
    assert parser.comments == 2


def test_one_byte_at_a_time_splits_lines_and_multibyte_characters():
    events, _ = parse([STREAM[i : i + 1] for i in range(len(STREAM))])
    assert events == EXPECTED
    content = json.loads(events[1])["choices"][0]["delta"]["content"]
    assert content == "日本語 🚀"  # 3- and 4-byte characters survived every split


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20))
def test_any_split_points(cuts):
    cuts = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0] + cuts, cuts + [len(STREAM)])]
    assert parse(pieces)[0] == EXPECTED


def test_event_name_is_kept():
    parser = SSEParser()
    events = parser.feed(b'event: error\ndata: {"error": "x"}\n\n')
    assert events[0].event == "error" and events[0].data == '{"error": "x"}'


def test_cut_off_stream_yields_what_arrived_and_no_done():
    cut = STREAM[: STREAM.index(b"data: [DONE]")] + b'data: {"partial": tr'
    events, _ = parse([cut])
    assert "[DONE]" not in events
    assert events[:4] == EXPECTED[:4]


def test_crlf_split_between_cr_and_lf_is_one_line_end():
    events, _ = parse([b"data: x\r", b"\n\r", b"\ndata: y\r\n\r\n"])
    assert events == ["x", "y"]
