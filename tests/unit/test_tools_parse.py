"""Tool calling without a model: the plan from tools/tool_choice, parsing output into tool_calls, the
streamed form of the calls, and the chat rendering that holds a choice's text back to parse it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmserve.server import tool_parsers as tools
from llmserve.server.api.chat import ChatRendering

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def auto(*fs) -> tools.ToolPlan:
    return tools.plan(list(fs or [WEATHER, TIME]), "auto")


def parse(text: str, p: tools.ToolPlan):
    return p.parse_text(text)


def args_of(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


# -- plan ------------------------------------------------------------------------------------------
def test_plan_without_tools():
    assert tools.plan(None, None) is None
    assert tools.plan([], "auto") is None
    with pytest.raises(tools.ToolError, match="requires tools"):
        tools.plan(None, "required")


def test_plan_choices():
    assert auto().choice == "auto" and auto().parse and not auto().forced
    none = tools.plan([WEATHER], "none")
    assert not none.parse
    required = tools.plan([WEATHER, TIME], "required")
    assert required.forced and len(required.forced_schema["anyOf"]) == 2
    named = tools.plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "function" and named.name == "get_time"
    assert named.forced_schema["properties"]["name"] == {"const": "get_time"}


@pytest.mark.parametrize(
    "tools_, choice, match",
    [
        ([{"type": "function"}], "auto", "each tool must be"),
        ([{"type": "function", "function": {"name": ""}}], "auto", "needs a name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "JSON schema object"),
        ([WEATHER, WEATHER], "auto", "unique"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER], {"type": "function"}, "must be"),
        ([WEATHER], "sometimes", "must be"),
    ],
)
def test_plan_refuses(tools_, choice, match):
    with pytest.raises(tools.ToolError, match=match):
        tools.plan(tools_, choice)


# -- parse -----------------------------------------------------------------------------------------
def test_plain_text_stays_content():
    assert parse("It is sunny in Paris.", auto()) == ("It is sunny in Paris.", [])


def test_one_call():
    content, calls = parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', auto())
    assert content is None
    assert len(calls) == 1
    c = calls[0]
    assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 5 + 24
    assert c["function"]["name"] == "get_weather" and args_of(c) == {"city": "Paris"}


def test_several_calls_with_text_around():
    text = (
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.'
    )
    content, calls = parse(text, auto())
    assert content == "Let me check.  Done."  # whitespace between calls is dropped
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [args_of(c) for c in calls] == [{"city": "Oslo"}, {}]
    assert calls[0]["id"] != calls[1]["id"]


def test_unclosed_tag_at_the_end_still_parses():
    _, calls = parse('<tool_call>{"name": "get_time", "arguments": {}}', auto())
    assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_bare_json_object_and_string_arguments():
    content, calls = parse(' {"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}', auto())
    assert content is None and args_of(calls[0]) == {"city": "Rome"}
    _, calls = parse('{"name": "get_weather", "parameters": {"city": "Lima"}}', auto())
    assert args_of(calls[0]) == {"city": "Lima"}


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # malformed JSON
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not a tool
        '<tool_call>["get_weather"]</tool_call>',  # not an object
        '<tool_call>{"name": "get_weather", "arguments": "{not json"}</tool_call>',  # bad arguments string
        '{"name": "get_weather", "arguments": {"city": "Paris"}',  # bare, unclosed
    ],
)
def test_no_valid_call_leaves_the_text_as_content(text):
    assert parse(text, auto()) == (text, [])


def test_a_bad_call_among_good_ones_stays_in_the_content():
    bad = '<tool_call>{"name": oops}</tool_call>'
    content, calls = parse(bad + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', auto())
    assert content == bad and [c["function"]["name"] for c in calls] == ["get_time"]


def test_forced_output_is_one_json_call():
    p = tools.plan([WEATHER], "required")
    content, calls = parse('{"name": "get_weather", "arguments": {"city": "Kyiv"}}', p)
    assert content is None and args_of(calls[0]) == {"city": "Kyiv"}


def test_non_ascii_arguments_are_kept():
    _, calls = parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>', auto())
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'


# -- streaming ---------------------------------------------------------------------------------------
def _out(text: str, finished: bool, finish_reason: str | None = None, delta: str | None = None):
    c = SimpleNamespace(
        text=text,
        delta_text=text if delta is None else delta,
        finish_reason=finish_reason,
        stop_reason=None,
        logprobs=None,
        delta_logprobs=None,
    )
    return SimpleNamespace(outputs=[c], finished=finished)


def test_chat_rendering_streams_the_calls_as_they_are_written():
    r = ChatRendering(tokenizer=None, tool_plan=auto())
    first = r.deltas(0, _out('Sure. <tool_call>{"name": "get_weather", "arguments": {"ci', finished=False))
    assert [c["delta"] for c in first] == [
        {"content": "Sure. "},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": first[1]["delta"]["tool_calls"][0]["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]},
    ]
    rest = r.deltas(0, _out("", finished=True, finish_reason="stop", delta='ty": "Oslo"}}</tool_call>'))
    assert [c["delta"] for c in rest[:-1]] == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}
    ]
    assert rest[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    message = r.choice(0, _out(text, finished=True, finish_reason="stop"))
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Sure."


def test_chat_rendering_without_calls_streams_text_as_it_comes():
    r = ChatRendering(tokenizer=None, tool_plan=tools.plan([WEATHER], "none"))  # "none": nothing parsed
    assert r.deltas(0, _out("Hi", finished=False)) == [
        {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
    ]
    assert r.choice(0, _out("Hi", finished=True, finish_reason="length"))["finish_reason"] == "length"
