"""Ollama's API without a model: options and format onto the sampling fields, messages onto the chat's,
the NDJSON lines and the JSON answer of chat and generate (fake engine outputs), the error shape."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from llmserve.errors import error_body_for
from llmserve.model.loader.gguf_facts import file_type_name
from llmserve.sampling_params import Logprob, TokenLogprobs
from llmserve.server import tool_parsers
from llmserve.server.api import ollama_messages as M
from llmserve.server.api import ollama_protocol as O
from llmserve.server.api.ollama_models import parameter_count, resolve, size_label, tagged
from llmserve.server.api.ollama_options import OLLAMA_DEFAULTS, parameters_text, sampling_fields
from llmserve.server.api.ollama_render import OllamaRendering, ollama_tool_calls
from llmserve.server.errors import APIError
from llmserve.server.reasoning import ReasoningParser


def test_options_map_onto_sampling_fields():
    body = O.ChatRequest(
        model="m",
        options={
            "temperature": 0,
            "top_k": 5,
            "top_p": 0.5,
            "stop": ["\n"],
            "seed": 7,
            "repeat_penalty": 1.2,
            "num_predict": 9,
            "num_ctx": 256,
            "num_gpu": 1,  # ignored
        },
        format="json",
    )
    s = sampling_fields(body)
    sf = s.fields
    assert (sf.temperature, sf.top_k, sf.top_p, sf.stop, sf.seed) == (0, 5, 0.5, ["\n"], 7)
    assert sf.repetition_penalty == 1.2 and sf.response_format == {"type": "json_object"}
    assert (s.predict, s.ctx, s.last_n) == (9, 256, 64)
    s = sampling_fields(O.ChatRequest(model="m", options={"seed": -1, "num_predict": -1}))
    assert s.fields.seed is None and s.predict is None
    schema = {"type": "object"}
    sf = sampling_fields(O.ChatRequest(model="m", format=schema)).fields
    assert sf.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def test_without_options_ollamas_defaults_then_the_models_own_parameters():
    s = sampling_fields(O.ChatRequest(model="m"))
    sf = s.fields
    assert (sf.temperature, sf.top_k, sf.top_p, sf.min_p, sf.repetition_penalty, s.last_n) == (0.8, 40, 0.9, 0, 1.1, 64)
    # the model's parameters over Ollama's defaults, the request's options over both
    defaults = {**OLLAMA_DEFAULTS, "temperature": 0.6, "top_k": 20}
    s = sampling_fields(O.ChatRequest(model="m", options={"top_k": 5}), defaults)
    assert (s.fields.temperature, s.fields.top_k, s.fields.top_p) == (0.6, 5, 0.9)
    # repeat_last_n: -1 the whole context, 0 no repeat penalty
    s = sampling_fields(O.ChatRequest(model="m", options={"repeat_last_n": -1}))
    assert s.last_n is None and s.fields.repetition_penalty == 1.1
    s = sampling_fields(O.ChatRequest(model="m", options={"repeat_last_n": 0}))
    assert s.last_n is None and s.fields.repetition_penalty == 1.0


def test_show_parameters_text_is_ollamas_layout():
    text = parameters_text({"temperature": 0.8, "stop": "<|im_end|>", "top_k": 40})
    assert text.splitlines() == [f'{"stop":<30} "<|im_end|>"', f"{'temperature':<30} 0.8", f"{'top_k':<30} 40"]


@pytest.mark.parametrize(
    "number, name", [(0, "F32"), (1, "F16"), (3, "Q4_1"), (7, "Q8_0"), (15, "Q4_K_M"), (32, "BF16"), (38, "MXFP4")]
)
def test_file_type_names_are_llama_cpps(number, name):
    assert file_type_name(number) == name


def test_file_type_unknown_or_guessed_is_none():
    assert file_type_name(1024) is None and file_type_name(9999) is None and file_type_name(None) is None


@pytest.mark.parametrize(
    "n, label",
    [(134_515_008, "134.52M"), (135_000_000, "135M"), (8_030_261_248, "8.0B"), (3_000_000_000, "3B"), (22_500, "22K")],
)
def test_parameter_size_is_ollamas_human_number(n, label):
    assert size_label(n) == label


@pytest.mark.parametrize(
    "options, where",
    [
        ({"temperature": -1}, "options.temperature"),
        ({"repeat_penalty": 0}, "options.repeat_penalty"),
        ({"num_predict": "x"}, "options.num_predict"),
    ],
)
def test_bad_options_are_400_naming_the_option(options, where):
    with pytest.raises(APIError) as e:
        sampling_fields(O.ChatRequest(model="m", options=options))
    assert e.value.status == 400 and e.value.message.startswith(where)


def test_messages_and_tool_calls_become_the_chats():
    msgs = M.chat_messages(
        [
            O.OllamaMessage(role="user", content="hi"),
            O.OllamaMessage(
                role="assistant", content="", tool_calls=[{"function": {"name": "f", "arguments": {"a": 1}}}]
            ),
            O.OllamaMessage(role="tool", content="2", tool_name="f"),
        ]
    )
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1].tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert msgs[2].name == "f"
    # images (bare base64) become image parts before the text, named where a 400 points at them
    (m,) = M.chat_messages([O.OllamaMessage(role="user", content="x", images=["aGk=", "aGk=\n"])])
    assert [type(p).__name__ for p in m.content] == ["ImagePart", "ImagePart", "TextPart"] and m.text() == "x"
    assert m.content[1].image_url.url == "data:image;base64,aGk=" and m.content[1]._where == "messages[0].images[1]"
    for bad in ("%%%", "data:image/png;base64,aGk=", ""):
        with pytest.raises(APIError) as e:
            M.chat_messages([O.OllamaMessage(role="user", content="x", images=["aGk=", bad])])
        assert e.value.status == 400 and e.value.message.startswith("messages[0].images[1]: "), e.value.message


def test_names_and_error_shape():
    assert tagged("smol") == "smol:latest" and tagged("smol:q4") == "smol:q4"
    assert error_body_for("/api/chat", 404, "no such model") == {"error": "no such model"}
    assert "type" in error_body_for("/v1/chat/completions", 404, "x")["error"]
    state = SimpleNamespace(check_model=lambda n: n if n == "smol" else (_ for _ in ()).throw(APIError(404, "nope")))
    assert resolve(state, "smol:latest") == "smol" and resolve(state, "smol") == "smol"
    with pytest.raises(APIError):
        resolve(state, "other:latest")


def test_parameter_count_of_a_small_llama():
    mc = SimpleNamespace(
        hidden_size=576,
        head_dim=64,
        num_heads=9,
        num_kv_heads=3,
        num_experts=0,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        num_layers=30,
    )
    assert 134e6 < parameter_count(mc) < 136e6  # SmolLM2-135M


# fake engine outputs and a fake Generation
def _out(text, delta, finished=False, finish_reason=None, n=1, logprobs=None, delta_logprobs=None):
    c = SimpleNamespace(text=text, delta_text=delta, finish_reason=finish_reason, token_ids=list(range(n)))
    c.logprobs, c.delta_logprobs = logprobs, delta_logprobs
    m = SimpleNamespace(arrival_time=1.0, first_scheduled_time=1.0, first_token_time=1.5, finished_time=2.0)
    return SimpleNamespace(outputs=[c], finished=finished, metrics=m)


def _gen(final):
    return SimpleNamespace(finals={0: final}, counts=lambda: (7, 5, 0), arrival=1.0, runs=[(0, 0, [1, 2], None)])


def _lines(rendering, pieces, finish_reason="stop"):
    acc, lines = "", []
    final = _out("".join(pieces), pieces[-1], True, finish_reason, 5)
    for k, p in enumerate(pieces):
        acc += p
        last = k == len(pieces) - 1
        out = final if last else _out(acc, p)
        lines += rendering.stream_output(_gen(final), 0, out)
    assert all(ln.endswith("\n") and "\n" not in ln[:-1] for ln in lines)
    return [json.loads(ln) for ln in lines]


def test_chat_stream_lines_and_done():
    lines = _lines(OllamaRendering("chat", "m:latest"), ["Hel", "lo"], "length")
    assert [ln["message"]["content"] for ln in lines] == ["Hel", "lo", ""]
    assert [ln["done"] for ln in lines] == [False, False, True]
    done = lines[-1]
    assert done["done_reason"] == "length" and done["model"] == "m:latest" and done["created_at"].endswith("Z")
    assert (done["prompt_eval_count"], done["eval_count"]) == (7, 5)
    assert done["total_duration"] == 1_000_000_000 and done["eval_duration"] == 500_000_000
    assert done["prompt_eval_duration"] == 500_000_000


def test_generate_body_with_thinking_and_context():
    r = OllamaRendering("generate", "m", ReasoningParser.from_name("qwen3"))
    final = _out("<think>hmm</think>It is 4.", "", True, "stop", 3)
    body = r.body(_gen(final))
    assert body["response"] == "It is 4." and body["thinking"] == "hmm" and body["done_reason"] == "stop"
    assert body["context"] == [1, 2, 0, 1, 2]
    # think=false: no thinking field
    body = OllamaRendering("generate", "m", ReasoningParser.from_name("qwen3"), think=False).body(_gen(final))
    assert "thinking" not in body


def test_chat_tool_calls_in_ollamas_shape():
    fn = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    plan = tool_parsers.plan([fn], None, tool_parsers.get_parser("hermes"))
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    body = OllamaRendering("chat", "m", None, plan).body(_gen(_out(text, "", True, "stop")))
    assert body["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert body["done_reason"] == "stop"
    lines = _lines(OllamaRendering("chat", "m", None, plan), [text[:20], text[20:]])
    assert [bool(ln["message"].get("tool_calls")) for ln in lines] == [True, False] and lines[-1]["done"]
    assert ollama_tool_calls([{"function": {"name": "f", "arguments": "not json"}}]) == [
        {"function": {"name": "f", "arguments": {}}}
    ]


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _lp(i):
    return TokenLogprobs(i, -0.5 * i, [Logprob(i, -0.5 * i), Logprob(i + 10, -3.0)])


def test_logprobs_when_asked_for():
    # the client's logprobs=true / top_logprobs: the answer's `logprobs`, one entry per generated token
    body = O.ChatRequest(model="m", logprobs=True, top_logprobs=2)
    assert body.logprob_count() == 2 and O.ChatRequest(model="m", top_logprobs=2).logprob_count() is None
    final = _out("ab", "", True, "stop", 2, logprobs=[_lp(1), _lp(2)])
    got = OllamaRendering("chat", "m", tokenizer=_Tok()).body(_gen(final))["logprobs"]
    assert [e["token"] for e in got] == ["<1>", "<2>"] and got[1]["logprob"] == -1.0
    assert got[0]["bytes"] == list(b"<1>") and [t["token"] for t in got[0]["top_logprobs"]] == ["<1>", "<11>"]
    assert "logprobs" not in OllamaRendering("chat", "m").body(_gen(final))
    # streamed: each line the tokens since the last line; a held-back piece's go with the next line
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plan = tool_parsers.plan([fn], None, tool_parsers.get_parser("hermes"))
    r, lines = OllamaRendering("generate", "m", None, plan, tokenizer=_Tok()), []
    for k, (acc, piece) in enumerate([("Hi", "Hi"), ("Hi<tool", "<tool"), ("Hi<tool x", " x")]):
        last = k == 2
        out = _out(acc, piece, last, "stop" if last else None, 3, [_lp(1), _lp(2), _lp(3)], [_lp(k + 1)])
        lines += [json.loads(ln) for ln in r.stream_output(_gen(out), 0, out)]
    assert [[e["token"] for e in ln.get("logprobs", [])] for ln in lines] == [["<1>"], ["<2>", "<3>"], []]
    assert "".join(ln["response"] for ln in lines) == "Hi<tool x" and lines[-1]["done"]


def test_embed_truncate_cuts_an_input_to_the_context():
    from llmserve.server.api import embeddings as E

    mc = SimpleNamespace(hidden_size=4, vocab_size=100)
    eng = SimpleNamespace(
        engine=SimpleNamespace(model_config=mc, max_model_len=8),
        tokenizer=SimpleNamespace(encode=lambda s: [1] * len(s)),
    )
    req = E.EmbeddingRequest(input=["abc", "x" * 20])
    runs = asyncio.run(E.runs(eng, req, "last", truncate=True))
    assert [len(r[2]) for r in runs] == [3, 7]  # room for the one step an embedding takes
    with pytest.raises(APIError) as e:
        asyncio.run(E.runs(eng, req, "last"))
    assert e.value.status == 400 and "input[1]" in e.value.message
    assert O.EmbedRequest(model="m", input="x").truncate  # Ollama's default


def test_stream_error_is_an_error_line():
    r = OllamaRendering("chat", "m")
    assert json.loads(r.stream_error(None, APIError(500, "boom"))[0]) == {"error": "boom"}


def test_router_reads_ollamas_bodies_and_answers_its_errors():
    from starlette.datastructures import Headers

    from llmserve.router.config import RouterConfig
    from llmserve.router.errors import RouterError
    from llmserve.router.proxy import route_request

    cfg = RouterConfig(chars_per_token=1.0)
    body = {"model": "smol:latest", "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 5}}
    req = route_request(body, Headers({}), cfg, "/api/chat")
    assert (req.model, req.stream, req.max_tokens, req.prompt_text) == ("smol", True, 5, "<user>Hi\n")
    assert not route_request({**body, "stream": False}, Headers({}), cfg, "/api/chat").stream
    assert not route_request({"model": "smol", "input": "x"}, Headers({}), cfg, "/api/embed").stream
    assert route_request(body, Headers({}), cfg, "/v1/chat/completions").model == "smol:latest"
    err = RouterError(502, "cut", "bad_gateway", "backend_stream_error")
    assert err.sse("/api/chat") == b'{"error": "cut"}\n'
