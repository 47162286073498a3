"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through a real `llmserve serve` and
the official anthropic client: plain and streamed (the event sequence, also through the SDK's accumulator),
stop sequences, tool_use / tool_result round trip, structured output, thinking blocks (--reasoning-parser),
x-api-key and Bearer auth, and every error in Anthropic's shape (the key check's 401 and validation included)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from llmserve.testing.launcher import ROUTE, ServerProcess

KEY = "sk-apis"  # the reasoning_server fixture's key (tests/e2e/conftest.py)
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
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
Q = [{"role": "user", "content": "What is Docker?"}]
GREEDY = {"temperature": 0}  # the SDK takes sampling fields as extra body fields
THINK = {"temperature": 0, "guided_regex": "<think>[a-z ]{5,40}</think>[A-Za-z ]{5,40}[.]"}


@pytest.fixture(scope="module")
def server(reasoning_server):
    return reasoning_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_plain_answer_equals_chat_greedy(server, client):
    m = client.messages.create(
        model="x", max_tokens=12, system="Answer in one sentence.", messages=Q, extra_body=GREEDY
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == "x"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).chat.completions.create(
        model="x", max_tokens=12, temperature=0, messages=[{"role": "system", "content": "Answer in one sentence."}] + Q
    )
    assert chat.choices[0].message.content == m.content[0].text
    assert chat.usage.prompt_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    n = client.messages.count_tokens(model="x", system="Answer in one sentence.", messages=Q)
    assert n.input_tokens == chat.usage.prompt_tokens


def test_stop_sequence(client):
    text = client.messages.create(model="x", max_tokens=20, messages=Q, extra_body=GREEDY).content[0].text
    word = text.split()[3]
    m = client.messages.create(model="x", max_tokens=20, messages=Q, stop_sequences=[word], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert text.startswith(m.content[0].text) and word not in m.content[0].text


def test_streamed_event_sequence(client):
    whole = client.messages.create(model="x", max_tokens=10, messages=Q, extra_body=GREEDY)
    events = list(client.messages.create(model="x", max_tokens=10, messages=Q, extra_body=GREEDY, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 10
    # the SDK's accumulator
    with client.messages.stream(model="x", max_tokens=10, messages=Q, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10


def test_tool_use_round_trip(client):
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(
        model="x", max_tokens=60, messages=q, tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY
    )
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, WEATHER["input_schema"])
    follow = q + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": json.dumps({"temp": 21})}],
        },
    ]
    m2 = client.messages.create(model="x", max_tokens=16, messages=follow, tools=[WEATHER], extra_body=GREEDY)
    assert m2.content and m2.usage.input_tokens + m2.usage.cache_read_input_tokens > m.usage.input_tokens
    # streamed with a named tool: input_json_delta, and the SDK parses the input
    with client.messages.stream(
        model="x",
        max_tokens=60,
        messages=q,
        tools=[WEATHER],
        extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds.count("input_json") >= 3  # the arguments as they are generated, not in one piece at the end
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])


def test_structured_output(client):
    m = client.messages.create(
        model="x",
        max_tokens=60,
        messages=[{"role": "user", "content": "Invent a person."}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(m.content[0].text), PERSON)


def test_thinking_blocks(client):
    q = [{"role": "user", "content": "What is two plus two?"}]
    m = client.messages.create(model="x", max_tokens=60, messages=q, extra_body=THINK)
    assert [b.type for b in m.content] == ["thinking", "text"]
    thought, answer = m.content[0].thinking, m.content[1].text
    assert thought and "<think>" not in thought and "</think>" not in answer
    with client.messages.stream(model="x", max_tokens=60, messages=q, extra_body=THINK) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == answer
    # the thinking block goes back in the history (and is dropped from the prompt)
    back = q + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "Thanks."},
    ]
    assert client.messages.create(model="x", max_tokens=4, messages=back, extra_body=GREEDY).content


def _check(exc: anthropic.APIStatusError, status: int, kind: str) -> None:
    assert exc.status_code == status, exc
    body = exc.response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=8, messages=Q, extra_body={"temperature": 1.5})
    _check(e.value, 400, "invalid_request_error")
    assert "temperature" in e.value.response.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=Q)
    _check(e.value, 404, "not_found_error")
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="x", max_tokens=8, messages=Q
        )
    _check(e.value, 401, "authentication_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="x",
            max_tokens=8,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}
            ],
        )
    _check(e.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=8, messages=Q, tools=[{"type": "bash_20250124", "name": "bash"}])
    _check(e.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.count_tokens(model="nope", messages=Q)
    _check(e.value, 404, "not_found_error")
    # raw: a missing max_tokens, a body that is not JSON, a Bearer key (also accepted), no key at all
    h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    for body in (b'{"model": "x", "messages": [{"role": "user", "content": "hi"}]}', b"{not json", b"[]"):
        r = httpx.post(server.url + "/v1/messages", content=body, headers={**h, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    ok = {"model": "x", "max_tokens": 2, "messages": Q}
    assert (
        httpx.post(
            server.url + "/v1/messages", json=ok, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        ).status_code
        == 200
    )
    r = httpx.post(server.url + "/v1/messages/count_tokens", json=ok)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # the OpenAI endpoints keep OpenAI's shape, and take x-api-key too
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": Q, "max_tokens": 2},
        headers={"x-api-key": KEY},
        timeout=60,
    )
    assert r.status_code == 200
    assert "param" in httpx.post(server.url + "/v1/chat/completions", json={}).json()["error"]


def test_through_the_router(server, tmp_path):
    """`llmserve route` forwards the Messages and Responses APIs (streams unbuffered) and answers its own
    errors on /v1/messages in Anthropic's shape."""
    router = ServerProcess(
        "--backend",
        server.url,
        "--api-key",
        KEY,
        "--backend-api-key",
        KEY,
        "--health-interval",
        "0.5",
        "--log-level",
        "warning",
        cmd=ROUTE,
        log_path=str(tmp_path / "router.log"),
    )
    try:
        router.wait_ready(60)
        via = anthropic.Anthropic(base_url=router.url, api_key=KEY, max_retries=0, timeout=120)
        m = via.messages.with_raw_response.create(model="x", max_tokens=6, messages=Q, extra_body=GREEDY)
        assert m.headers["x-llmserve-backend"] == server.url and m.parse().content[0].text
        with via.messages.stream(model="x", max_tokens=6, messages=Q, extra_body=GREEDY) as stream:
            assert "".join(stream.text_stream) == m.parse().content[0].text
        assert via.messages.count_tokens(model="x", messages=Q).input_tokens > 0
        r = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0).responses.create(
            model="x", input="What is Docker?", max_output_tokens=6, temperature=0, stream=True
        )
        assert [e.type for e in r][-1] == "response.incomplete"
        with pytest.raises(anthropic.NotFoundError) as e:
            via.messages.create(model="claude-opus-4-1", max_tokens=6, messages=Q)
        _check(e.value, 404, "not_found_error")
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=router.url, api_key="wrong", max_retries=0).messages.create(
                model="x", max_tokens=6, messages=Q
            )
        _check(e.value, 401, "authentication_error")
        r = httpx.post(
            router.url + "/v1/responses",
            json={"model": "nope", "input": "x"},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    finally:
        router.kill()
