"""Agent and structured-output clients we did not write, against a real `llmserve serve` (the bundled model):
openai-agents, pydantic-ai, instructor and langchain-openai, each used as its own docs show.

The bundled 135M model is too small to pick a tool by itself, so each test forces the call the way the
client lets its users (a named tool_choice, or the client's own forcing mode): llmserve holds a forced call
to the tool's schema by the grammar, so the call always parses. Every request the client sends is recorded
(an httpx event hook on the client's own http client), so the tests check the wire too: the tool's result
went back to the model in the next request, under the call's id."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from llmserve.testing.launcher import ServerProcess

agents = pytest.importorskip("agents")
pydantic_ai = pytest.importorskip("pydantic_ai")
instructor = pytest.importorskip("instructor")
langchain_openai = pytest.importorskip("langchain_openai")


class Weather(BaseModel):
    city: str
    temperature: int


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Recorder:
    """The JSON bodies a client sends, in order (sync and async httpx event hooks)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def _record(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content or b"{}"))

    def client(self) -> httpx.Client:
        return httpx.Client(timeout=120, event_hooks={"request": [self._record]})

    def async_client(self) -> httpx.AsyncClient:
        async def record(request: httpx.Request) -> None:
            self._record(request)

        return httpx.AsyncClient(timeout=120, event_hooks={"request": [record]})


@pytest.fixture(scope="module")
def url():
    with ServerProcess("--num-threads", "1", "--served-model-name", "x") as srv:
        yield srv.wait_ready().url + "/v1"


def _chat_tool_result_went_back(body: dict, tool_name: str, result: str) -> dict:
    """The request after a call: the assistant's call, then the tool's result under its id. The call's args."""
    call_msg, result_msg = body["messages"][-2:]
    (call,) = call_msg["tool_calls"]
    assert call_msg["role"] == "assistant" and call["function"]["name"] == tool_name
    assert result_msg == {**result_msg, "role": "tool", "tool_call_id": call["id"]}
    assert result in json.dumps(result_msg["content"])
    return json.loads(call["function"]["arguments"])


# -- openai-agents --------------------------------------------------------------------------------------
@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_function_tool_then_output_type(url, api, streamed):
    """An Agent with a function_tool and an output_type: turn 1 calls the tool (ModelSettings.tool_choice
    names it, and the SDK sends the output_type's response_format with it), the SDK runs it and sends the
    result back (tool_choice reset to auto), turn 2 is the output_type's JSON. Chat completions through
    OpenAIChatCompletionsModel, and the Responses API through OpenAIResponsesModel."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"Sunny, 21 C in {city}"

    rec = Recorder()
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, http_client=rec.async_client())
    cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        output_type=Weather,
        model=cls(model="x", openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=40),
    )

    async def run():
        if not streamed:
            return await Runner.run(agent, "Weather in Paris?", max_turns=4), []
        r = Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
        kinds = [ev.type async for ev in r.stream_events()]
        return r, kinds

    result, kinds = asyncio.run(run())
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, Weather)
    assert len(rec.bodies) == 2 and all(b.get("stream", False) is streamed for b in rec.bodies)
    first, second = rec.bodies
    if api == "chat":
        assert first["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        assert first["response_format"]["type"] == "json_schema"
        assert _chat_tool_result_went_back(second, "get_weather", "Sunny, 21 C") == {"city": calls[0]}
    else:
        assert first["tool_choice"] == {"type": "function", "name": "get_weather"}
        call, output = second["input"][-2:]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": calls[0]}
        assert output["type"] == "function_call_output" and output["call_id"] == call["call_id"]
        assert "Sunny, 21 C" in json.dumps(output["output"])
    assert second.get("tool_choice") in (None, "auto")
    if streamed:
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


# -- pydantic-ai ----------------------------------------------------------------------------------------
def test_pydantic_ai_tool_then_output_tool(url):
    """An Agent with an output_type (pydantic-ai's output tool, final_result) and a plain tool, through
    OpenAIChatModel + OpenAIProvider: step 1 is forced to the tool, step 2 to the output tool (per-step model
    settings, pydantic-ai's way to force a tool once); the run ends with a validated output."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    rec = Recorder()
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, http_client=rec.async_client())
    model = OpenAIChatModel("x", provider=OpenAIProvider(openai_client=client))
    agent = Agent(
        model,
        output_type=Person,
        model_settings=lambda ctx: {
            "temperature": 0,
            "max_tokens": 60,
            "tool_choice": ["lookup_age"] if ctx.run_step <= 1 else ["final_result"],
        },
    )
    looked_up: list[str] = []

    @agent.tool_plain
    def lookup_age(name: str) -> int:
        """The age of a person."""
        looked_up.append(name)
        return 31

    r = agent.run_sync("How old is Alice?")
    assert isinstance(r.output, Person)
    assert len(looked_up) == 1 and looked_up[0]
    assert [b["tool_choice"]["function"]["name"] for b in rec.bodies] == ["lookup_age", "final_result"]
    assert _chat_tool_result_went_back(rec.bodies[1], "lookup_age", "31") == {"name": looked_up[0]}
    assert {t["function"]["name"] for t in rec.bodies[0]["tools"]} == {"lookup_age", "final_result"}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_output_type_streamed(url, api):
    """Without function tools pydantic-ai sends tool_choice "required" over its output tool: one request,
    streamed by run_stream (the output validated as the call's arguments come), through OpenAIChatModel and
    OpenAIResponsesModel."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    rec = Recorder()
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, http_client=rec.async_client())
    cls = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(
        cls("x", provider=OpenAIProvider(openai_client=client)),
        output_type=Person,
        model_settings={"temperature": 0, "max_tokens": 60},
    )

    async def run():
        async with agent.run_stream("Alice is 31.") as r:
            return [o async for o in r.stream_output()]

    outputs = asyncio.run(run())
    assert outputs[-1] == Person(name="Alice", age=31)
    (body,) = rec.bodies
    assert body["tool_choice"] == "required" and body["stream"] is True


# -- instructor -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_model(url, mode):
    """instructor's modes that force the shape: TOOLS (a named tool_choice) and JSON_SCHEMA (response_format
    json_schema). Its JSON mode (json_object, the schema only in the prompt) is model quality, not the
    server: the bundled model does not follow it."""
    rec = Recorder()
    raw = openai.OpenAI(base_url=url, api_key="x", max_retries=0, http_client=rec.client())
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    p = client.chat.completions.create(
        model="x",
        response_model=Person,
        messages=[{"role": "user", "content": "Alice is 31."}],
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    assert isinstance(p, Person) and p.age == 31
    (body,) = rec.bodies
    if mode == "JSON_SCHEMA":
        assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    else:
        assert body["tool_choice"] == {"type": "function", "function": {"name": "Person"}}


def test_instructor_responses_tools(url):
    """Mode.RESPONSES_TOOLS sends a named tool_choice and the schema as text.format too (the forced call wins)."""
    rec = Recorder()
    raw = openai.OpenAI(base_url=url, api_key="x", max_retries=0, http_client=rec.client())
    client = instructor.from_openai(raw, mode=instructor.Mode.RESPONSES_TOOLS)
    p = client.responses.create(
        model="x", response_model=Person, input="Alice is 31.", temperature=0, max_output_tokens=60, max_retries=0
    )
    assert isinstance(p, Person) and p.age == 31
    (body,) = rec.bodies
    assert body["tool_choice"] == {"type": "function", "name": "Person"} and body["text"]["format"]["type"]


def test_instructor_partial_stream(url):
    """create_partial: the streamed call's argument pieces, parsed as they come, end as the whole model."""
    raw = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    parts = list(
        client.chat.completions.create_partial(
            model="x",
            response_model=Person,
            messages=[{"role": "user", "content": "Alice is 31."}],
            temperature=0,
            max_tokens=60,
        )
    )
    assert len(parts) > 2
    assert parts[-1].name == "Alice" and parts[-1].age == 31
    assert parts[0].age is None  # the first pieces come before the whole call


# -- langchain-openai -----------------------------------------------------------------------------------
def _lc(url: str, rec: Recorder | None = None, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="x",
        base_url=url,
        api_key="x",
        temperature=0,
        max_tokens=60,
        max_retries=0,
        **({"http_client": rec.client()} if rec else {}),
        **kw,
    )


def test_langchain_bind_tools_round_trip_and_stream(url):
    """bind_tools with a named tool_choice: the AIMessage's tool_calls hold args matching the tool's schema;
    the ToolMessage goes back under the call's id; the same call streamed assembles to the same call."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """Current weather in a city."""
        return f"21 degrees {unit} in {city}"

    rec = Recorder()
    llm = _lc(url, rec)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    m = forced.invoke("Weather in Paris?")
    (call,) = m.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    get_weather.args_schema.model_validate(call["args"])
    result = get_weather.invoke(call["args"])
    llm.bind_tools([get_weather]).invoke(
        [HumanMessage("Weather in Paris?"), m, ToolMessage(result, tool_call_id=call["id"])]
    )
    assert _chat_tool_result_went_back(rec.bodies[1], "get_weather", result) == call["args"]

    acc = None
    chunks = 0
    for ch in forced.stream("Weather in Paris?"):
        acc, chunks = (ch if acc is None else acc + ch), chunks + 1
    assert chunks > 3
    (streamed,) = acc.tool_calls
    assert (streamed["name"], streamed["args"]) == (call["name"], call["args"]) and streamed["id"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(url, method):
    """with_structured_output: function_calling (a named tool_choice) and json_schema (response_format),
    invoked and streamed (json_mode: below)."""
    llm = _lc(url).with_structured_output(Person, method=method)
    p = llm.invoke("Alice is 31.")
    assert isinstance(p, Person) and p.age == 31
    assert list(llm.stream("Alice is 31."))[-1] == p


def test_langchain_json_mode_with_the_keys_in_the_prompt(url):
    """json_mode sends response_format json_object and no schema: the keys go in the prompt (as LangChain's
    docs have it), and the bundled model follows a prompt that names them."""
    rec = Recorder()
    llm = _lc(url, rec).with_structured_output(Person, method="json_mode")
    p = llm.invoke("Extract the person as JSON with keys name and age: John is 30 years old.")
    assert p == Person(name="John", age=30)
    assert rec.bodies[-1]["response_format"] == {"type": "json_object"}


def test_langchain_on_the_responses_api(url):
    """use_responses_api=True: a forced call invoked and streamed, and with_structured_output (text.format)."""
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "21"

    rec = Recorder()
    llm = _lc(url, rec, use_responses_api=True)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    (call,) = forced.invoke("Weather in Paris?").tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    acc = None
    for ch in forced.stream("Weather in Paris?"):
        acc = ch if acc is None else acc + ch
    (streamed,) = acc.tool_calls
    assert (streamed["name"], streamed["args"]) == (call["name"], call["args"])
    assert llm.with_structured_output(Person).invoke("Alice is 31.") == Person(name="Alice", age=31)
    assert all(b.get("input") for b in rec.bodies) and len(rec.bodies) == 3
