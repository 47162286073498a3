"""vLLM's request and serving options that users carry over: several --served-model-name, GET /v1/models/{id},
--max-logprobs, logit_bias, --generation-config / --override-generation-config; a real server, the openai
client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from llmserve.testing.launcher import ServerProcess

Q = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5, "do_sample": True}))
    with ServerProcess(
        "--served-model-name", "smol", "smol-alias",
        "--max-logprobs", "30",
        "--generation-config", str(folder),
        "--override-generation-config", '{"max_new_tokens": 6}',
        "--num-threads", "1",
    ) as srv:  # fmt: skip
        yield srv.wait_ready()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_every_served_name_is_listed_retrievable_and_served(client):
    assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
    assert client.models.retrieve("smol-alias").id == "smol-alias"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"
    r = client.chat.completions.create(model="smol-alias", messages=Q, max_tokens=2)
    assert r.model == "smol"  # answers carry the first name, as vLLM's do


def test_generation_config_fills_what_a_request_leaves_out(client):
    default = client.chat.completions.create(model="smol", messages=Q)  # temperature 0 and 6 tokens at most
    again = client.chat.completions.create(model="smol", messages=Q)
    greedy = client.chat.completions.create(model="smol", messages=Q, temperature=0, max_tokens=6)
    assert default.choices[0].message.content == again.choices[0].message.content == greedy.choices[0].message.content
    assert default.usage.completion_tokens <= 6
    longer = client.chat.completions.create(model="smol", messages=Q, max_tokens=10, extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 10  # a request's own max_tokens wins


def test_max_logprobs_bounds_every_kind_of_logprobs(client, server):
    r = client.chat.completions.create(model="smol", messages=Q, max_tokens=2, logprobs=True, top_logprobs=25)
    assert all(len(t.top_logprobs) == 25 for t in r.choices[0].logprobs.content)
    c = client.completions.create(model="smol", prompt="One, two,", max_tokens=2, logprobs=30)
    assert all(len(t) == 30 for t in c.choices[0].logprobs.top_logprobs)
    for call in (
        lambda: client.chat.completions.create(model="smol", messages=Q, max_tokens=2, logprobs=True, top_logprobs=31),
        lambda: client.completions.create(model="smol", prompt="x", max_tokens=2, logprobs=31),
        lambda: client.completions.create(model="smol", prompt="x", max_tokens=2, extra_body={"prompt_logprobs": 31}),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert "max-logprobs" in e.value.body["message"]


def test_logit_bias_forces_and_bans_tokens(client, server):
    (token,) = httpx.post(server.url + "/tokenize", json={"prompt": "Paris", "add_special_tokens": False}).json()[
        "tokens"
    ]
    forced = client.completions.create(
        model="smol", prompt="The capital of Italy is", max_tokens=3, logit_bias={str(token): 100}
    )
    assert forced.choices[0].text == "Paris" * 3
    plain = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=1, logprobs=0)
    first = plain.choices[0].text
    (first_id,) = httpx.post(server.url + "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()[
        "tokens"
    ]
    banned = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=1, logit_bias={str(first_id): -100}
    )
    assert banned.choices[0].text != first
    for bias in ({"10000000": 1}, {"abc": 1}, {"5": 101}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smol", messages=Q, max_tokens=2, logit_bias=bias)
        assert "logit_bias" in e.value.body["message"]
    assert client.chat.completions.create(model="smol", messages=Q, max_tokens=2).usage.completion_tokens >= 1
