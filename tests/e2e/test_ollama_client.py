"""Ollama's API through the clients people use, against a real `llmserve serve` on the bundled model: the
official `ollama` client (Client and AsyncClient, whose typed responses must validate) and langchain-ollama
(ChatOllama, OllamaEmbeddings). tests/e2e/test_ollama.py checks the wire format with httpx; here the clients
decide what a good answer is: chat and generate, plain and streamed (the chunks assemble to the greedy
text), raw and system prompts, format json and a pydantic model's schema, options, logprobs, a Python
function as a tool and a tool call the model makes, think (and the API key) on the shared reasoning server,
embed and the legacy embeddings, list, show, ps, pull, and errors as ResponseError with the HTTP status."""

from __future__ import annotations

import asyncio
import math
from datetime import datetime

import ollama
import ollama._types as ollama_types
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_ollama import ChatOllama, OllamaEmbeddings
from pydantic import BaseModel, Field

NAME = "smol"
MODEL = f"{NAME}:latest"
STORY = "Write a long story about a cat."
Q = [{"role": "user", "content": STORY}]
# greedy without Ollama's default repeat penalty (1.1 over the last 64 tokens): the most likely token each step
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 12, "repeat_penalty": 1.0}
KEY = "sk-apis"  # the reasoning_server fixture's key (tests/e2e/conftest.py)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
      a: the first number
      b: the second number

    Returns:
      int: their sum
    """
    return a + b


@pytest.fixture(scope="module")
def server(ollama_server):
    return ollama_server


@pytest.fixture(scope="module")
def client(server):
    with ollama.Client(host=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def greedy(client) -> ollama.ChatResponse:
    """The greedy chat answer to STORY that the other ways of asking must reproduce."""
    return client.chat(MODEL, Q, options=GREEDY)


def test_list_show_ps(client):
    (m,) = client.list().models
    assert m.model == MODEL and isinstance(m.modified_at, datetime) and m.size > 0 and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family and m.details.parameter_size.endswith("M")
    for name in (NAME, MODEL):
        show = client.show(name)
        assert isinstance(show, ollama.ShowResponse) and isinstance(show.modified_at, datetime)
        assert {"completion", "tools"} <= set(show.capabilities) and "{%" in show.template
        assert show.modelinfo["general.parameter_count"] > 1e8 and show.details.family == m.details.family
    (p,) = client.ps().models
    assert p.model == p.name == MODEL and p.context_length == 512 and p.digest == m.digest
    assert p.expires_at.year == 9999 and p.size == m.size and p.size_vram >= 0


def test_chat_plain_and_streamed(client, greedy):
    assert isinstance(greedy, ollama.ChatResponse) and greedy.done and greedy.done_reason == "length"
    assert greedy.model == MODEL and greedy.message.role == "assistant" and greedy.message.content
    assert greedy.eval_count == 12 and greedy.prompt_eval_count > 5 and greedy.total_duration >= greedy.eval_duration
    assert greedy.message.tool_calls is None and greedy.message.thinking is None
    parts = list(client.chat(MODEL, Q, options=GREEDY, stream=True))
    assert all(isinstance(p, ollama.ChatResponse) for p in parts) and len(parts) > 2
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == greedy.message.content
    last = parts[-1]
    assert last.done_reason == "length" and last.eval_count == 12 and last.prompt_eval_count == greedy.prompt_eval_count
    # options as the client's typed Options; top_k 1 is greedy whatever the temperature
    top1 = client.chat(MODEL, Q, options=ollama.Options(top_k=1, num_predict=12, repeat_penalty=1.0))
    assert top1.message.content == greedy.message.content


def test_generate(client, greedy):
    g = client.generate(MODEL, STORY, options=GREEDY)
    assert isinstance(g, ollama.GenerateResponse) and g.response == greedy.message.content
    assert g.done_reason == "length" and g.eval_count == 12 and len(g.context) == g.prompt_eval_count + 12
    parts = list(client.generate(MODEL, STORY, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == g.response and parts[-1].done and not parts[0].done
    # system: the same as a chat that opens with that system message
    pirate = "You are a pirate. Answer as one."
    sys_gen = client.generate(MODEL, "Hi", system=pirate, options=GREEDY)
    sys_chat = client.chat(
        MODEL, [{"role": "system", "content": pirate}, {"role": "user", "content": "Hi"}], options=GREEDY
    )
    assert sys_gen.response == sys_chat.message.content and sys_gen.prompt_eval_count == sys_chat.prompt_eval_count
    # raw: the prompt as is, no template
    raw = client.generate(MODEL, "The capital of France is", raw=True, options=GREEDY)
    assert raw.response and raw.prompt_eval_count < 10 and raw.eval_count == 12
    # num_predict, stop
    stop = client.generate(MODEL, STORY, options={**GREEDY, "num_predict": 60, "stop": ["."]})
    assert "." not in stop.response and stop.done_reason == "stop" and stop.eval_count < 60
    assert stop.response.startswith(g.response)


def test_logprobs(client, greedy):
    r = client.chat(MODEL, Q, options=GREEDY, logprobs=True, top_logprobs=2)
    assert r.message.content == greedy.message.content and len(r.logprobs) == r.eval_count == 12
    assert all(isinstance(e, ollama_types.Logprob) and e.logprob <= 0 and len(e.top_logprobs) == 2 for e in r.logprobs)
    assert "".join(e.token for e in r.logprobs) == r.message.content
    assert all(e.top_logprobs[0].token == e.token for e in r.logprobs)  # greedy: the most likely one
    parts = list(client.generate(MODEL, STORY, options=GREEDY, logprobs=True, stream=True))
    streamed = [e for p in parts for e in (p.logprobs or [])]
    assert [e.token for e in streamed] == [e.token for e in r.logprobs] and not streamed[0].top_logprobs
    assert client.chat(MODEL, Q, options=GREEDY).logprobs is None


def test_format_json_and_a_pydantic_schema(client):
    ask = [{"role": "user", "content": "Give a person as JSON."}]
    r = client.chat(MODEL, ask, format=Person.model_json_schema(), options={"temperature": 0})
    person = Person.model_validate_json(r.message.content)
    assert person.name and r.done_reason == "stop"
    g = client.generate(MODEL, "A person as JSON:", format=Person.model_json_schema(), options={"temperature": 0})
    assert Person.model_validate_json(g.response)
    j = client.generate(MODEL, "A JSON object:", format="json", options={**GREEDY, "num_predict": 40})
    assert j.response.lstrip().startswith("{")


def test_a_python_function_as_a_tool(client):
    # the client turns the function into a tool (its docstring: the descriptions); asked plainly, the small
    # model answers in text: the answer is a ChatResponse all the same
    r = client.chat(MODEL, [{"role": "user", "content": "What is 2+3?"}], tools=[add], options=GREEDY)
    assert isinstance(r, ollama.ChatResponse) and isinstance(r.message.content, str) and r.done
    # with an earlier call and its result in the history (the client's own typed messages), it calls again
    call = ollama.Message.ToolCall(function=ollama.Message.ToolCall.Function(name="add", arguments={"a": 2, "b": 3}))
    history = [
        {"role": "user", "content": "What is 2+3?"},
        ollama.Message(role="assistant", content="", tool_calls=[call]),
        ollama.Message(role="tool", content="5", tool_name="add"),
    ]
    opts = {"temperature": 0, "num_predict": 40, "repeat_penalty": 1.0}
    r = client.chat(MODEL, history, tools=[add], options=opts)
    (c,) = r.message.tool_calls
    assert isinstance(c, ollama.Message.ToolCall) and c.function.name == "add"
    assert isinstance(add(**c.function.arguments), int) and r.done_reason == "stop"
    parts = list(client.chat(MODEL, history, tools=[add], options=opts, stream=True))
    with_calls = [p for p in parts if p.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done and parts[-1].done
    assert with_calls[0].message.tool_calls == r.message.tool_calls


def test_think(client):
    # the client sends think; this server runs without --reasoning-parser: thinking is refused, as Ollama
    # refuses it for a model that cannot think, and think=False is a plain answer
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(MODEL, Q, think=True, options=GREEDY)
    assert e.value.status_code == 400 and "thinking" in e.value.error
    r = client.chat(MODEL, Q, think=False, options=GREEDY)
    assert r.message.thinking is None and r.message.content
    assert client.generate(MODEL, STORY, think=False, options=GREEDY).thinking is None


def test_think_and_the_api_key_on_a_reasoning_server(reasoning_server):
    # the shared server with --api-key and --reasoning-parser qwen3 (tests/e2e/conftest.py), as "x"
    with ollama.Client(host=reasoning_server.url, timeout=120) as anonymous:
        with pytest.raises(ollama.ResponseError) as e:
            anonymous.list()
        assert e.value.status_code == 401
    with ollama.Client(host=reasoning_server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        assert "thinking" in c.show("x").capabilities
        r = c.chat("x", Q, think=True, options=GREEDY)
        # the bundled model answers at once (no <think>): all of it is content, no thinking
        assert r.message.content and r.message.thinking is None and r.eval_count == 12
        parts = list(c.chat("x", Q, think=True, options=GREEDY, stream=True))
        assert "".join(p.message.content for p in parts) == r.message.content
        assert c.generate("x", STORY, think="low", options=GREEDY).response == r.message.content


def test_embed_and_embeddings(client):
    one = client.embed(MODEL, "Paris is in France.")
    assert isinstance(one, ollama.EmbedResponse) and len(one.embeddings) == 1 and one.prompt_eval_count > 3
    assert math.isclose(sum(x * x for x in one.embeddings[0]), 1, abs_tol=1e-3)
    two = client.embed(MODEL, ["Paris is in France.", "def f(): pass"])
    assert len(two.embeddings) == 2 and max(abs(a - b) for a, b in zip(two.embeddings[0], one.embeddings[0])) < 1e-4
    # an input over the context: cut to it (truncate, true unless the client says false) or a 400
    long = client.embed(MODEL, ["word " * 600, "Paris is in France."])
    assert long.prompt_eval_count == 511 + one.prompt_eval_count and len(long.embeddings) == 2
    assert max(abs(a - b) for a, b in zip(long.embeddings[1], one.embeddings[0])) < 1e-4
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(MODEL, "word " * 600, truncate=False)
    assert e.value.status_code == 400 and "context length" in e.value.error
    legacy = client.embeddings(MODEL, "Paris is in France.")
    assert isinstance(legacy, ollama.EmbeddingsResponse)
    assert max(abs(a - b) for a, b in zip(legacy.embedding, one.embeddings[0])) < 1e-4


def test_pull(client):
    r = client.pull(MODEL)
    assert isinstance(r, ollama.ProgressResponse) and r.status == "success"
    parts = list(client.pull(NAME, stream=True))
    assert parts and all(isinstance(p, ollama.ProgressResponse) for p in parts) and parts[-1].status == "success"
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            list(client.pull("llama3.2", stream=True)) if stream else client.pull("llama3.2")
        assert e.value.status_code == 404 and "llama3.2" in e.value.error


def test_errors_are_response_errors(client):
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            r = client.chat(MODEL, Q, options={"temperature": -1}, stream=stream)
            list(r) if stream else r
        assert e.value.status_code == 400 and "options.temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(MODEL, "Hi", options={"num_predict": "many"})
    assert e.value.status_code == 400 and "options.num_predict" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("nope:latest", Q)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(MODEL)
    assert e.value.status_code == 501


def test_async_client(server, greedy):
    async def go():
        async with ollama.AsyncClient(host=server.url, timeout=120) as c:
            r = await c.chat(MODEL, Q, options=GREEDY)
            parts = [p async for p in await c.chat(MODEL, Q, options=GREEDY, stream=True)]
            g = [p async for p in await c.generate(MODEL, STORY, options=GREEDY, stream=True)]
            emb = await c.embed(MODEL, ["a", "b"])
            return r, parts, g, emb, await c.list()

    r, parts, g, emb, listed = asyncio.run(go())
    assert r.message.content == greedy.message.content
    assert "".join(p.message.content for p in parts) == greedy.message.content and parts[-1].eval_count == 12
    assert "".join(p.response for p in g) == greedy.message.content
    assert len(emb.embeddings) == 2 and listed.models[0].model == MODEL


def test_langchain_ollama(server, client, greedy):
    llm = ChatOllama(
        model=NAME,
        base_url=server.url,
        temperature=0,
        repeat_penalty=1.0,
        seed=1,
        num_predict=12,
        validate_model_on_init=True,
    )
    m = llm.invoke(STORY)
    assert m.content == greedy.message.content and m.response_metadata["done_reason"] == "length"
    assert m.usage_metadata["output_tokens"] == 12 and m.usage_metadata["input_tokens"] == greedy.prompt_eval_count
    chunks = list(llm.stream(STORY))
    assert "".join(c.content for c in chunks) == greedy.message.content
    # a tool round trip in langchain's messages: its AIMessage tool_calls and ToolMessage go back as Ollama's
    history = [
        HumanMessage("What is 2+3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}]),
        ToolMessage("5", tool_call_id="call_1"),
    ]
    tooled = ChatOllama(model=NAME, base_url=server.url, temperature=0, repeat_penalty=1.0, num_predict=40)
    tooled = tooled.bind_tools([add])
    (call,) = tooled.invoke(history).tool_calls
    assert call["name"] == "add" and isinstance(add(**call["args"]), int)
    structured = ChatOllama(model=NAME, base_url=server.url, temperature=0, num_predict=60)
    person = structured.with_structured_output(Person, method="json_schema").invoke("Bob is 3 years old.")
    assert isinstance(person, Person) and person.name
    emb = OllamaEmbeddings(model=NAME, base_url=server.url, validate_model_on_init=True)
    docs = emb.embed_documents(["Paris is in France.", "def f(): pass"])
    ref = client.embed(MODEL, ["Paris is in France.", "def f(): pass"]).embeddings
    assert len(docs) == 2 and max(abs(a - b) for a, b in zip(docs[1], ref[1])) < 1e-4
    assert max(abs(a - b) for a, b in zip(emb.embed_query("Paris is in France."), ref[0])) < 1e-4
    with pytest.raises(ValueError, match="not found"):
        ChatOllama(model="nope", base_url=server.url, validate_model_on_init=True)
