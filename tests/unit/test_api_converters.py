"""The Responses and Messages APIs as chats (their converters), their renderings driven by fake engine outputs
(event order, items and blocks, stop reasons, usage), and the two error shapes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmserve import errors
from llmserve.server import tool_parsers as tools
from llmserve.server.api import messages as A
from llmserve.server.api import responses as R
from llmserve.server.errors import APIError, from_value_error
from llmserve.server.reasoning import ReasoningParser

WEATHER_R = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_A = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_R["parameters"]}


def _roles(msgs):
    return [(m.role, m.text(), m.tool_calls, m.tool_call_id) for m in msgs]


# -- Responses ---------------------------------------------------------------------------------------------
def test_responses_string_input_and_instructions():
    body = R.ResponsesRequest(input="Hi", instructions="Be brief.")
    assert _roles(R.chat_messages(body)) == [("system", "Be brief.", None, None), ("user", "Hi", None, None)]


def test_responses_items_round_trip_a_tool_call():
    body = R.ResponsesRequest(
        input=[
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "25 C"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Warm."}]},
        ]
    )
    msgs = _roles(R.chat_messages(body))
    assert msgs[0] == ("developer", "Use tools.", None, None)
    assert msgs[1] == ("user", "Weather in Paris?", None, None)
    role, text, calls, _ = msgs[2]  # both calls in one assistant turn, the reasoning item dropped
    assert role == "assistant" and text == ""
    assert [c["id"] for c in calls] == ["c1", "c2"] and calls[1]["function"]["arguments"] == '{"city": "Rome"}'
    assert msgs[3:] == [("tool", "21 C", None, "c1"), ("tool", "25 C", None, "c2"), ("assistant", "Warm.", None, None)]


@pytest.mark.parametrize(
    "items,where",
    [
        ([{"role": "wizard", "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}], "input[0].content[0].image_url"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0]"),
        ([{"type": "function_call", "name": "f"}], "input[0]"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0]"),
        ([{"type": "web_search_call"}], "input[0].type"),
        ([], "input"),
    ],
)
def test_responses_bad_items_name_the_item(items, where):
    with pytest.raises(ValueError) as e:
        R.chat_messages(R.ResponsesRequest(input=items))
    err = from_value_error(e.value)
    assert err.status == 400 and err.param == where, err.message


def test_responses_tools_and_formats():
    chat, choice = R.chat_tools([WEATHER_R], {"type": "function", "name": "get_weather"})
    plan = tools.plan(chat, choice)
    assert plan.choice == "function" and plan.name == "get_weather"
    assert chat[0]["function"]["parameters"] == WEATHER_R["parameters"]
    with pytest.raises(ValueError, match="only function tools"):
        R.chat_tools([{"type": "web_search"}], None)
    body = R.ResponsesRequest(input="x", text={"format": {"type": "json_schema", "name": "p", "schema": {}}})
    assert body.response_format == {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}}
    assert R.ResponsesRequest(input="x", text={"format": {"type": "json_object"}}).response_format == {
        "type": "json_object"
    }
    assert R.ResponsesRequest(input="x").response_format is None


def test_responses_stateless_refusals():
    for fields, param in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
    ):
        with pytest.raises(APIError) as e:
            R.check_stateless(R.ResponsesRequest(input="x", **fields))
        assert e.value.status == 400 and e.value.param == param
    R.check_stateless(R.ResponsesRequest(input="x", store=True))  # store is accepted, answered false


# fake engine outputs and a fake Generation
class _Tok:
    def encode(self, text, add_special_tokens=True):
        return text.split()


def _out(text, delta, finished=False, finish_reason=None, stop_reason=None):
    c = SimpleNamespace(
        text=text,
        delta_text=delta,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        token_ids=text.split(),
        logprobs=None,
        delta_logprobs=None,
    )
    return SimpleNamespace(outputs=[c], finished=finished, num_cached_tokens=0)


def _gen(final):
    return SimpleNamespace(created=1, model="m", finals={0: final}, counts=lambda: (7, 5, 2))


def _stream(rendering, pieces, finish_reason="stop", stop_reason=None):
    text = "".join(pieces)
    final = _out(text, pieces[-1], True, finish_reason, stop_reason)
    gen = _gen(final)
    events = rendering.stream_open(gen)
    acc = ""
    for k, p in enumerate(pieces):
        acc += p
        last = k == len(pieces) - 1
        events += rendering.stream_output(
            gen, 0, _out(acc, p, last, finish_reason if last else None, stop_reason if last else None)
        )
    events += rendering.stream_close(gen)
    parsed = []
    for ev in events:
        head, data = ev.split("\n")[0], ev.split("\n")[1]
        d = json.loads(data[len("data: ") :])
        assert head == f"event: {d['type']}" and ev.endswith("\n\n")
        parsed.append(d)
    return parsed, gen


def test_responses_stream_events_with_reasoning():
    body = R.ResponsesRequest(input="x")
    r = R.ResponsesRendering(_Tok(), body, None, ReasoningParser.from_name("qwen3"))
    events, gen = _stream(r, ["<thi", "nk>two plus", " two</think>\n", "It is", " 4."])
    types = [e["type"] for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["store"] is False
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "two plus two"
    assert message["content"][0]["text"] == "It is 4." and message["status"] == "completed"
    assert final["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 12,
    }
    # the JSON body holds the same items
    body_items = R.ResponsesRendering(_Tok(), body, None, ReasoningParser.from_name("qwen3")).body(gen)["output"]
    assert [(i["type"], i["content"][0]["text"]) for i in body_items] == [
        ("reasoning", "two plus two"),
        ("message", "It is 4."),
    ]


def test_responses_function_calls_and_incomplete():
    plan = tools.plan(*R.chat_tools([WEATHER_R], "auto"))
    r = R.ResponsesRendering(_Tok(), R.ResponsesRequest(input="x"), plan)
    events, _ = _stream(r, ['<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>'])
    types = [e["type"] for e in events]
    assert "response.output_text.delta" not in types
    assert types[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    call = events[-1]["response"]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Oslo"} and call["call_id"].startswith("call_")
    r = R.ResponsesRendering(_Tok(), R.ResponsesRequest(input="x", max_output_tokens=2), None)
    events, _ = _stream(r, ["Hello", " there"], finish_reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    r = R.ResponsesRendering(_Tok(), R.ResponsesRequest(input="x"), None)  # no text at all: an empty message
    assert r.body(_gen(_out("", "", True, "stop")))["output"][0]["content"][0]["text"] == ""


def test_responses_text_then_a_call_streamed_in_pieces():
    plan = tools.plan(*R.chat_tools([WEATHER_R], "auto"))
    r = R.ResponsesRendering(_Tok(), R.ResponsesRequest(input="x"), plan)
    chunks = ['Sure. <tool_call>{"name": "get_weather", "arguments": {"ci', 'ty": "Oslo"}}</tool_call>']
    events, _ = _stream(r, chunks)
    steps = [(e["type"], e.get("delta")) for e in events[2:]]
    assert steps[:2] == [("response.output_item.added", None), ("response.content_part.added", None)]
    assert steps[2] == ("response.output_text.delta", "Sure. ")
    added = steps.index(("response.output_item.added", None), 3)
    assert steps[added + 1 : added + 3] == [
        ("response.function_call_arguments.delta", '{"ci'),
        ("response.function_call_arguments.delta", 'ty": "Oslo"}'),
    ]
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call"] and output[1]["status"] == "completed"


def test_responses_stream_error_events():
    r = R.ResponsesRendering(_Tok(), R.ResponsesRequest(input="x"), None)
    gen = _gen(_out("", "", True, "stop"))
    r.stream_open(gen)
    events = [json.loads(e.split("\n")[1][6:]) for e in r.stream_error(gen, APIError(504, "too slow", code="t"))]
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[0]["message"] == "too slow" and events[1]["response"]["status"] == "failed"


# -- Messages ----------------------------------------------------------------------------------------------
def test_messages_as_chat():
    body = A.MessagesRequest(
        model="m",
        max_tokens=5,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 C"}]},
                    {"type": "text", "text": "And now?"},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x", "is_error": True}],
            },
        ],
    )
    msgs = _roles(A.chat_messages(body))
    assert msgs[0] == ("system", "Be brief.", None, None)
    assert msgs[1] == ("user", "Weather in Paris?", None, None)
    role, text, calls, _ = msgs[2]
    assert (role, text) == ("assistant", "Checking.") and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Paris"
    }
    assert msgs[3:] == [
        ("tool", "21 C", None, "toolu_1"),
        ("user", "And now?", None, None),
        ("tool", "Error: x", None, "toolu_2"),
    ]


@pytest.mark.parametrize(
    "content,where",
    [
        ([{"type": "image", "source": {}}], "messages[0].content[0]"),
        ([{"type": "tool_use", "id": "x", "name": "f"}], "messages[0].content[0]"),  # tool_use from the user
        ([{"type": "tool_result", "tool_use_id": 3}], "messages[0].content[0].tool_use_id"),
        ([{"text": "no type"}], "messages[0].content[0]"),
    ],
)
def test_messages_bad_blocks_name_the_block(content, where):
    with pytest.raises(ValueError) as e:
        A.chat_messages(A.MessagesRequest(model="m", max_tokens=5, messages=[{"role": "user", "content": content}]))
    assert from_value_error(e.value).param == where


def test_messages_tools_choice_thinking_and_format():
    for choice, want in (
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, "function"),
    ):
        assert tools.plan(*A.chat_tools([WEATHER_A], choice)).choice == want
    with pytest.raises(ValueError, match="client tools"):
        A.chat_tools([{"type": "bash_20250124", "name": "bash"}], None)
    with pytest.raises(ValueError, match="tool_choice"):
        A.chat_tools([WEATHER_A], {"type": "sometimes"})
    body = A.MessagesRequest(
        model="m",
        max_tokens=5,
        messages=[{"role": "user", "content": "x"}],
        thinking={"type": "disabled"},
        stop_sequences=["\n"],
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
    )
    assert body.template_kwargs() == {"enable_thinking": False} and body.stop == ["\n"]
    assert body.response_format["json_schema"]["schema"] == {"type": "object"}


def test_messages_stream_events_blocks_and_stop_reasons():
    body = A.MessagesRequest(model="m", max_tokens=50, messages=[{"role": "user", "content": "x"}])
    r = A.MessagesRendering(body, None, ReasoningParser.from_name("deepseek_r1"))
    events, gen = _stream(r, ["two plus", " two</think>", "It is", " 4."], stop_reason="END")
    types = [e["type"] for e in events]
    assert types == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[2]["delta"] == {"type": "thinking_delta", "thinking": "two plus"}
    assert events[6]["delta"] == {"type": "text_delta", "text": "It is"} and events[6]["index"] == 1
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[-2]["usage"] == {
        "input_tokens": 5,
        "output_tokens": 5,
        "cache_read_input_tokens": 2,
        "cache_creation_input_tokens": 0,
    }
    msg = A.MessagesRendering(body, None, ReasoningParser.from_name("deepseek_r1")).body(gen)
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"] and msg["content"][1]["text"] == "It is 4."
    plan = tools.plan(*A.chat_tools([WEATHER_A], {"type": "any"}))
    r = A.MessagesRendering(body, plan)
    events, _ = _stream(r, ['{"name": "get_weather", "arguments": ', '{"city": "Oslo"}}'])
    assert events[1]["content_block"]["type"] == "tool_use" and events[1]["content_block"]["input"] == {}
    assert json.loads(events[2]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    r = A.MessagesRendering(body, None)
    events, _ = _stream(r, ["a", "b"], finish_reason="length")
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert A.MessagesRendering(body, None).stream_error(None, APIError(429, "full")) == [
        'event: error\ndata: {"type": "error", "error": {"type": "rate_limit_error", "message": "full"}}\n\n'
    ]


# -- error shapes ------------------------------------------------------------------------------------------
def test_error_shapes_by_path():
    assert errors.error_body_for("/v1/messages", 401, "no key") == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "no key"},
    }
    assert errors.error_body_for("/v1/messages/count_tokens", 404, "x")["error"]["type"] == "not_found_error"
    assert errors.error_body_for("/v1/messagesX", 404, "x")["error"]["type"] == "not_found_error"
    assert "param" in errors.error_body_for("/v1/messagesX", 404, "x")["error"]  # OpenAI's shape there
    for status, kind in (
        (400, "invalid_request_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (502, "api_error"),
    ):
        assert errors.anthropic_error_type(status) == kind
    assert errors.error_body_for("/v1/responses", 400, "bad", "input", "invalid_value") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "input", "code": "invalid_value"}
    }


# -- the router's routing facts for the new bodies -------------------------------------------------------
def test_router_reads_responses_and_messages_bodies():
    from starlette.datastructures import Headers

    from llmserve.router.config import RouterConfig
    from llmserve.router.proxy import route_request

    cfg = RouterConfig(chars_per_token=1.0)
    msgs = route_request(
        {
            "model": "m",
            "max_tokens": 7,
            "system": [{"type": "text", "text": "Be brief."}],
            "metadata": {"user_id": "u1"},
            "stream": True,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "42"}]}
                    ],
                },
            ],
        },
        Headers({}),
        cfg,
    )
    assert msgs.prompt_text == '<system>Be brief.\n<user>Hi\n<assistant>{"a": 1}\n<user>42\n'
    assert (msgs.max_tokens, msgs.session_key, msgs.stream, msgs.model) == (7, "u1", True, "m")
    resp = route_request(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                {"type": "function_call_output", "call_id": "c", "output": "42"},
            ],
            "instructions": "Be brief.",
            "max_output_tokens": 9,
        },
        Headers({}),
        cfg,
    )
    assert resp.prompt_text == "<system>Be brief.\n<user>Hi\n<function_call_output>42\n"
    assert resp.max_tokens == 9 and resp.prompt_tokens == len(resp.prompt_text)
    assert route_request({"input": "Hi", "instructions": "Be brief."}, Headers({}), cfg).prompt_text == (
        "<system>Be brief.\n<user>Hi\n"
    )
    emb = route_request({"input": [[1, 2, 3], [4]]}, Headers({}), cfg)
    assert emb.prompt_text == "1 2 3\n4"
    assert route_request({"input": [5, 6]}, Headers({}), cfg).prompt_tokens == 2


def test_router_keys_image_parts_by_their_content():
    """Chat image_url parts, Responses input_image, Anthropic image blocks and Ollama's images: each picture is a
    short hash in the prompt text the policies key on (the same picture, the same key; another, another)."""
    from starlette.datastructures import Headers

    from llmserve.router.config import RouterConfig
    from llmserve.router.proxy import route_request

    cfg = RouterConfig()

    def chat(url):
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        return route_request({"messages": [{"role": "user", "content": parts}]}, Headers({}), cfg).prompt_text

    def responses(url):
        parts = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is it?"}]
        return route_request({"input": [{"role": "user", "content": parts}]}, Headers({}), cfg).prompt_text

    def anthropic(data):
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        return route_request({"messages": [{"role": "user", "content": [block]}]}, Headers({}), cfg).prompt_text

    def ollama(data):
        msg = {"role": "user", "content": "What is it?", "images": [data]}
        return route_request({"messages": [msg]}, Headers({}), cfg, "/api/chat").prompt_text

    a, b = "data:image/png;base64,AAAA", "data:image/png;base64,BBBB"
    for read in (chat, responses, anthropic, ollama):
        assert read(a) == read(a) != read(b), read.__name__
        assert "<image " in read(a) and "AAAA" not in read(a)
    assert chat(a).endswith("What is it?\n") and len(chat(a)) < 64
