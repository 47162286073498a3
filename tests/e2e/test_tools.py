"""Structured output and tool calling through a real `llmserve serve` and the official openai client."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import openai
import pytest

from llmserve.testing.launcher import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["tz"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
Q = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--num-threads", "1", "--served-model-name", "x")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _check_call(call):
    assert call.type == "function" and call.id
    assert call.function.name in PARAMS
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_required_round_trip(client):
    r = client.chat.completions.create(
        model="x", messages=Q, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    _check_call(call)
    # the tool result goes back; the model answers
    msgs = Q + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    r2 = client.chat.completions.create(model="x", messages=msgs, tools=TOOLS, temperature=0, max_tokens=16)
    m = r2.choices[0].message
    assert m.content or m.tool_calls
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model="x",
        messages=Q,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                c["id"] = d.id
            if d.function and d.function.name:
                c["name"] = d.function.name
            if d.function and d.function.arguments:
                c["arguments"] += d.function.arguments
        finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_time" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS["get_time"])


def test_streamed_call_sends_its_arguments_as_they_are_generated(client):
    """The SDK's stream accumulator sees argument deltas before the call ends (the default parser, hermes,
    the bare call object a forced tool_choice makes the model write)."""
    kinds, pieces = [], []
    with client.chat.completions.stream(
        model="x",
        messages=Q,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    ) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "tool_calls.function.arguments.delta":
                pieces.append(ev.arguments_delta)
        final = stream.get_final_completion()
    assert len(pieces) >= 3
    assert kinds.index("tool_calls.function.arguments.delta") < kinds.index("tool_calls.function.arguments.done")
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and "".join(pieces) == call.function.arguments
    _check_call(call)


def test_tool_choice_none_and_bad_choices(client):
    r = client.chat.completions.create(
        model="x", messages=Q, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            model="x",
            messages=Q,
            tools=TOOLS,
            max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def test_response_format_json_schema_streamed_and_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "A person?"}], response_format=rf, temperature=0, max_tokens=60
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    text = ""
    for chunk in client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Someone?"}],
        response_format=rf,
        temperature=0.8,
        seed=1,
        max_tokens=60,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    jsonschema.validate(json.loads(text), PERSON)


def test_vllm_extras_and_bad_schema(client):
    r = client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Pick."}],
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["red", "blue"]},
    )
    assert r.choices[0].message.content in ("red", "blue")
    c = client.completions.create(
        model="x", prompt="Code:", max_tokens=10, temperature=0, extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"}
    )
    assert len(c.choices[0].text) == 4
    with pytest.raises(openai.BadRequestError, match="response_format") as e:
        client.chat.completions.create(
            model="x",
            messages=Q,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}},
        )
    assert "objekt" in str(e.value)


TEMPLATE = (
    "{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "(call as <tool_call><function=NAME>...</function></tool_call>)\n{% endif %}"
    "{{ greeting | default('none') }}\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_flag_and_kwargs(tmp_path):
    """--chat-template FILE replaces the model's template; the tool-call parser is chosen from it;
    chat_template_kwargs reach it; `tools` go to it (it renders them)."""
    f = tmp_path / "tpl.jinja"
    f.write_text(TEMPLATE)
    with ServerProcess("--num-threads", "1", "--served-model-name", "x", "--chat-template", str(f)) as srv:
        srv.wait_ready()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert "tool calls: the qwen3_coder parser (from the chat template)" in srv.log()
        base = c.chat.completions.create(model="x", messages=Q, max_tokens=1).usage.prompt_tokens
        kw = c.chat.completions.create(
            model="x", messages=Q, max_tokens=1, extra_body={"chat_template_kwargs": {"greeting": "a b c d e"}}
        )
        assert kw.usage.prompt_tokens == base + 4  # "none" -> "a b c d e" (one token each, in this vocabulary)
        tools = c.chat.completions.create(model="x", messages=Q, tools=TOOLS, tool_choice="required", max_tokens=40)
        assert tools.usage.prompt_tokens > base and tools.choices[0].message.tool_calls


def test_unknown_tool_call_parser_is_a_startup_error():
    r = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "serve", "--tool-call-parser", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "--tool-call-parser" in r.stderr and "'nope'" in r.stderr
    assert "hermes" in r.stderr and "qwen3_coder" in r.stderr


def test_a_malformed_call_in_the_output_stays_content(server, client):
    """The model writes a call to a function that is not among the tools (made to, here, by a regex): the answer
    is a 200 whose content is that text, no tool calls, and the log says why; streamed the same."""
    bad = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
    extra = {"guided_regex": re.escape(bad)}
    r = client.chat.completions.create(model="x", messages=Q, tools=TOOLS, max_tokens=40, extra_body=extra)
    m = r.choices[0]
    assert (m.message.content, m.message.tool_calls, m.finish_reason) == (bad, None, "stop")
    stream = client.chat.completions.create(
        model="x", messages=Q, tools=TOOLS, max_tokens=40, extra_body=extra, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == bad
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "stop"
    assert "a malformed tool call is kept as content: " in server.log()


NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System messages are not supported') }}"
    "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_on_a_template_that_cannot_render_them(tmp_path):
    """A chat template without tools gets them as the default tools prompt, a system message (the documented
    fallback); one that cannot take that message either refuses with a 400 naming `messages`, never a 500."""
    f = tmp_path / "tpl.jinja"
    f.write_text(NO_SYSTEM_TEMPLATE)
    with ServerProcess("--num-threads", "1", "--served-model-name", "x", "--chat-template", str(f)) as srv:
        srv.wait_ready()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert c.chat.completions.create(model="x", messages=Q, max_tokens=1).choices[0].finish_reason
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="x", messages=Q, tools=TOOLS, max_tokens=1)
        assert e.value.status_code == 400 and e.value.body["param"] == "messages"
        assert "could not render" in e.value.body["message"] and "System messages" in e.value.body["message"]
