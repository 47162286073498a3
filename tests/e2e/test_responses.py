"""OpenAI's Responses API (POST /v1/responses) through a real `llmserve serve` and the official openai client:
plain and streamed (the official event sequence, also through the SDK's own stream accumulator), function
tools round trip, structured output, reasoning items (--reasoning-parser), errors in OpenAI's shape. The
same server checks reasoning_content in chat completions."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

KEY = "sk-apis"  # the reasoning_server fixture's key (tests/e2e/conftest.py)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# the bundled model does not think: a grammar makes it write <think>...</think> so the parser has work
THINK = {"guided_regex": "<think>[a-z ]{5,40}</think>[A-Za-z ]{5,40}[.]"}


@pytest.fixture(scope="module")
def server(reasoning_server):
    return reasoning_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_plain_answer_equals_chat_greedy(client):
    r = client.responses.create(
        model="x", input="What is Docker?", instructions="Answer in one sentence.", max_output_tokens=12, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "x"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.store is False
    chat = client.chat.completions.create(
        model="x",
        max_tokens=12,
        temperature=0,
        messages=[
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "What is Docker?"},
        ],
    )
    assert chat.choices[0].message.content == r.output_text  # the same chat, the same greedy tokens
    assert chat.usage.prompt_tokens == r.usage.input_tokens


def test_streamed_event_sequence(client):
    kwargs = dict(
        model="x",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
        max_output_tokens=10,
        temperature=0,
    )
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # the SDK's own accumulator (strict about item identity and order; it wants response.completed)
    kwargs["extra_body"] = {"guided_choice": ["Hello there!", "Hi!"]}
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "Hello there!"


def test_function_call_round_trip(client):
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(
        model="x", input=q, tools=[WEATHER], tool_choice="required", temperature=0, max_output_tokens=60
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the call and its output go back as input items; the model answers
    follow = q + [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp": 21})},
    ]
    r2 = client.responses.create(model="x", input=follow, tools=[WEATHER], temperature=0, max_output_tokens=16)
    assert r2.output and r2.usage.input_tokens > r.usage.input_tokens


def test_named_function_streamed(client):
    events = list(
        client.responses.create(
            model="x",
            input="Weather in Oslo?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=60,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.output_text.delta" not in types
    # the arguments stream as they are generated: several deltas, after the item opened, before it is done
    deltas = [k for k, t in enumerate(types) if t == "response.function_call_arguments.delta"]
    assert len(deltas) >= 3
    assert types.index("response.output_item.added") < deltas[0] < types.index("response.function_call_arguments.done")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    final = events[-1].response
    assert final.output[0].type == "function_call" and final.output[0].arguments == done.arguments


def test_structured_output(client):
    r = client.responses.create(
        model="x",
        input="Invent a person.",
        temperature=0,
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def test_reasoning_item_and_chat_reasoning_content(client):
    r = client.responses.create(
        model="x", input="What is two plus two?", temperature=0, max_output_tokens=60, extra_body=THINK
    )
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought and "<think>" not in thought and "</think>" not in r.output_text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(
        client.responses.create(
            model="x", input="What is two plus two?", temperature=0, max_output_tokens=60, extra_body=THINK, stream=True
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    # chat completions: reasoning_content, whole and in deltas
    msgs = [{"role": "user", "content": "What is two plus two?"}]
    c = client.chat.completions.create(model="x", messages=msgs, temperature=0, max_tokens=60, extra_body=THINK)
    m = c.choices[0].message
    assert m.reasoning_content == thought and m.content == r.output_text
    deltas = [
        ch.choices[0].delta
        for ch in client.chat.completions.create(
            model="x", messages=msgs, temperature=0, max_tokens=60, extra_body=THINK, stream=True
        )
        if ch.choices
    ]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == m.content
    # an answer without the marker stays content
    plain = client.chat.completions.create(model="x", messages=msgs, temperature=0, max_tokens=5)
    assert plain.choices[0].message.content and plain.choices[0].message.reasoning_content is None


def test_errors_in_openai_shape(server, client):
    def check(exc: openai.APIStatusError, status: int, param: str | None = None):
        assert exc.status_code == status
        err = exc.response.json()["error"]
        assert err["message"] and err["type"] and "code" in err
        if param:
            assert err["param"] == param, err

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="x", input="hi", temperature=5)
    check(e.value, 400, "temperature")
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-17", input="hi")
    check(e.value, 404, "model")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="x", input="hi", previous_response_id="resp_123")
    check(e.value, 400, "previous_response_id")
    assert "stores no responses" in e.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="x", input="hi", tools=[{"type": "web_search"}])
    check(e.value, 400, "tools[0]")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="x", input=[{"type": "input_image", "role": "user", "content": "x"}])
    check(e.value, 400, "input[0].type")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="x", input="hi " * 2000)
    check(e.value, 400, "input")
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).responses.create(
            model="x", input="hi"
        )
    check(e.value, 401)
    r = httpx.post(server.url + "/v1/responses", json={"model": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
