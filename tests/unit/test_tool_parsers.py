"""The tool-call parsers (llmserve/server/tool_parsers/), one format each, on answers written as each
format's public description gives them: the calls of a whole answer, and the same calls from the answer
streamed in any chunking (hypothesis), with each call's id and name first and its arguments in pieces."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.serve_config import TOOL_CALL_PARSERS
from llmserve.server import tool_parsers as tp
from llmserve.server.state import read_chat_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "tags": {"type": "array"}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
PARIS = {"city": "Paris", "days": 3}

# (parser, answer, content, [(name, arguments)])
FIXTURES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     None, [("get_weather", PARIS)]),
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"Z\\" {x}"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Checking.", [("get_weather", {"city": 'Zürich "Z" {x}'}), ("get_time", {})]),
    ("hermes", '{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ("hermes", "No tools needed: 2 < 3 and {curly} braces.", "No tools needed: 2 < 3 and {curly} braces.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
     '{"name": "get_time", "parameters": {}}', None, [("get_weather", PARIS), ("get_time", {})]),
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     '{"name": "get_time", "arguments": {}}]', None, [("get_weather", PARIS), ("get_time", {})]),
    ("mistral", 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
     "Let me look.", [("get_weather", PARIS), ("get_time", {})]),
    ("mistral", "Just text [with brackets].", "Just text [with brackets].", []),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time()]', None, [("get_weather", PARIS), ("get_time", {})]),
    ("pythonic", "<|python_start|>[get_weather(city='Pa, (ris)', tags=['a', None, True])]<|python_end|>", None,
     [("get_weather", {"city": "Pa, (ris)", "tags": ["a", None, True]})]),
    ("pythonic", "[1] is a footnote.", "[1] is a footnote.", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", None, [("get_weather", PARIS)]),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=tags>\n"
     '["x", 1]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>',
     "Sure.", [("get_weather", {"city": "42", "tags": ["x", 1]}), ("get_time", {})]),
    ("openai", "<|channel|>analysis<|message|>Weather, so call it.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>', None,
     [("get_weather", PARIS)]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 3 pm."
     "<|return|>", "It is 3 pm.", []),
    ("openai", '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
     '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris", "days": 3}<|call|>',
     None, [("get_time", {}), ("get_weather", PARIS)]),
]  # fmt: skip
IDS = [f"{f[0]}-{k}" for k, f in enumerate(FIXTURES)]


def parser(name: str) -> tp.ToolParser:
    return tp.PARSERS[name](TOOLS)


def streamed(p: tp.ToolParser, text: str, cuts: list[int], max_calls: int | None = None) -> list[tp.ToolDelta]:
    s, out, last = p.stream(max_calls), [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        out += s.feed(text[last:c])
        last = c
    return out + s.flush()


@pytest.mark.parametrize("name, text, content, calls", FIXTURES, ids=IDS)
def test_the_whole_answer(name, text, content, calls):
    got_content, got = parser(name).parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"] for c in got)
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("name, text, content, calls", FIXTURES, ids=IDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_same_calls(name, text, content, calls, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    p = parser(name)
    whole_content, whole = p.parse(text)
    deltas = streamed(p, text, cuts)
    got_content, got = tp.collect(deltas)
    assert [c["function"] for c in got] == [c["function"] for c in whole]
    assert (got_content or "").strip() == (whole_content or "").strip()
    seen: set[int] = set()
    for d in deltas:  # per call: its id and name once, first; then only arguments
        if d.index is None:
            continue
        assert (d.id is not None) == (d.index not in seen)
        seen.add(d.index)


def test_arguments_stream_before_the_call_ends():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Llanfairpwllgwyngyll", "days": 3}}</tool_call>'
    s = parser("hermes").stream()
    out = [d for k in range(len(text)) for d in s.feed(text[k])]
    pieces = [d.arguments for d in out if d.index == 0 and d.id is None]
    assert out[0].name == "get_weather" and len(pieces) > 10
    assert "".join(pieces) == '{"city": "Llanfairpwllgwyngyll", "days": 3}'


@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
        ("hermes", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": oops}'),
        ("pythonic", "[get_weather(city=Paris)]"),
        ("qwen3_coder", "<tool_call>\n<function=launch_rockets>\n</function>\n</tool_call>"),
    ],
)
def test_a_malformed_call_stays_content_with_a_log_line(name, text, caplog):
    assert parser(name).parse(text) == (text, [])
    assert "malformed tool call" in caplog.text


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = parser("mistral").parse("[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_time[ARGS]{}")
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert tp.PARSERS["mistral"].keep_special_tokens


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    content, calls = parser("llama3_json").parse(text, max_calls=1)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    p = tp.plan(TOOLS, "auto", tp.PARSERS["llama3_json"], parallel=False)
    assert [c["function"]["name"] for c in p.parse_text(text)[1]] == ["get_time"]


def test_a_forced_call_is_read_as_a_bare_object_whatever_the_parser():
    p = tp.plan(TOOLS, "required", tp.PARSERS["mistral"])
    assert not p.keeps_specials
    assert p.parse_text('{"name": "get_time", "arguments": {}}')[1][0]["function"]["name"] == "get_time"


def test_registry_names_and_choice_from_the_template():
    assert tuple(tp.PARSERS) == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="unknown parser 'nope'; choose from hermes, llama3_json"):
        tp.get_parser("nope")
    assert tp.choose(None) is tp.PARSERS["hermes"]
    assert tp.choose("{{ '<tool_call>' }}{% if tools %}<function=x>{% endif %}").name == "qwen3_coder"
    assert tp.choose("{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert tp.choose("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]").name == "mistral"
    assert tp.choose("<|python_start|>{{ m }}").name == "pythonic"
    assert tp.choose("Environment: ipython\n<|python_tag|>").name == "llama3_json"


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(f)) == f.read_text()
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja chat template"):
        read_chat_template("no-such-file.jinja")


def test_server_settings_pick_the_parser_and_refuse_auto_without_the_flag():
    from llmserve.serve_config import ServerSettings
    from llmserve.server.state import ServerState

    state = ServerState(ServerSettings(tool_call_parser="pythonic"))
    assert state.plan_tools(TOOLS, "auto", False).new_parser().name == "pythonic"
    off = ServerState(ServerSettings(enable_auto_tool_choice=False))
    with pytest.raises(tp.ToolError, match='"auto" needs --enable-auto-tool-choice'):
        off.plan_tools(TOOLS, None)
    assert off.plan_tools(TOOLS, "required").forced
    with pytest.raises(ValueError, match="unknown parser 'nope'"):
        ServerState(ServerSettings(tool_call_parser="nope"))


def test_openai_analysis_is_reasoning():
    from llmserve.server.rendering import ChoiceText

    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi.<|return|>"
    t = ChoiceText.whole(text, None, tp.plan(TOOLS, "auto", tp.PARSERS["openai"]))
    assert (t.reasoning, t.calls()) == ("Think.", ("Hi.", []))
    assert tp.plan(TOOLS, "auto", tp.PARSERS["openai"]).keeps_specials
    assert tp.choose("{{ '<|start|>assistant<|channel|>final<|message|>' }}").name == "openai"


def test_qwen3_coder_streams_a_string_parameter_as_it_is_written():
    s = parser("qwen3_coder").stream()
    head = s.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fran")
    assert [(d.name, d.arguments) for d in head] == [("get_weather", ""), (None, '{"city": "San Fran')]
    rest = s.feed("cisco\n</parameter>\n</function>\n</tool_call>", final=True)
    assert "".join(d.arguments for d in rest) == 'cisco"}'


def test_strict_tools_under_auto_get_a_structural_tag():
    from types import SimpleNamespace

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    kw = tp.guided_kwargs(SimpleNamespace(), tp.plan([strict, TIME], "auto"))
    tag = json.loads(kw["guided_structural_tag"])["format"]
    assert tag["triggers"] == ["<tool_call>"]
    assert [s["content"]["json_schema"] for s in tag["tags"]] == [WEATHER["function"]["parameters"], {"type": "object"}]
    assert tp.guided_kwargs(SimpleNamespace(), tp.plan(TOOLS, "auto")) == {}  # no strict tool: free
    for name in tp.PARSERS:  # every format is held (tests/integration/test_guided.py checks the grammars)
        assert json.loads(tp.plan([strict], "auto", tp.PARSERS[name]).strict_tag())["type"] == "structural_tag"
    rf = SimpleNamespace(response_format={"type": "json_object"})
    assert tp.guided_kwargs(rf, tp.plan([strict], "auto")) == {"guided_json_object": True}


def test_a_forced_call_wins_over_response_format():
    """openai-agents sends an Agent's output_type as response_format with ModelSettings.tool_choice: OpenAI
    answers with the call (the format is for a text answer); guided_* with a forced call stays a 400."""
    from types import SimpleNamespace

    rf = SimpleNamespace(response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": {}}})
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        p = tp.plan(TOOLS, choice)
        assert tp.guided_kwargs(rf, p) == {"guided_json": json.dumps(p.forced_schema)}
    with pytest.raises(ValueError, match="guided_"):
        tp.guided_kwargs(SimpleNamespace(guided_regex="a+"), tp.plan(TOOLS, "required"))


@pytest.mark.parametrize("name", list(tp.PARSERS))
def test_the_default_tools_prompt_asks_for_the_parsers_format(name):
    """A template that cannot render tools gets the default tools prompt: it asks for calls in the format of
    the parser in force, and the history's calls are written in that format, which the parser reads back."""
    p = tp.plan(TOOLS, "auto", tp.PARSERS[name])
    history = [
        {"role": "user", "content": "Weather and time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
    ]
    msgs, tools = tp.render_messages(history, p, native=False)
    assert tools is None and msgs[0]["role"] == "system"
    assert msgs[0]["content"].endswith(tp.PARSERS[name].instructions) and '"get_weather"' in msgs[0]["content"]
    others = [c.instructions for n, c in tp.PARSERS.items() if n != name]
    assert tp.PARSERS[name].instructions and tp.PARSERS[name].instructions not in others
    _, calls = parser(name).parse(msgs[2]["content"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", PARIS),
        ("get_time", {}),
    ]
    assert "tool_calls" not in msgs[2]


def test_the_tools_prompt_and_calls_go_into_parts_content():
    """A vision-language model's chat has contents as parts (text and images): the tools prompt and the history's
    calls are added as text parts, the image parts stay where they were, and an added system message is parts."""
    p = tp.plan(TOOLS, "auto", tp.PARSERS["hermes"])
    image = {"type": "image"}
    call = {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    history = [
        {"role": "user", "content": [image, {"type": "text", "text": "Time?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": None, "tool_call_id": "a"},
    ]
    msgs, _ = tp.render_messages(history, p, native=False)
    assert msgs[0]["role"] == "system" and [q["type"] for q in msgs[0]["content"]] == ["text"]
    assert '"get_weather"' in msgs[0]["content"][0]["text"]
    assert msgs[1] == history[0]
    written = tp.PARSERS["hermes"]([]).format_calls([("get_time", {})])
    assert msgs[2] == {"role": "assistant", "content": [{"type": "text", "text": written}]}
    assert msgs[3]["content"] == []  # (no content: no parts, never a string among parts)
    system = [{"type": "text", "text": "Be brief."}]
    msgs, _ = tp.render_messages([{"role": "system", "content": system}, history[0]], p, native=False)
    assert msgs[0]["content"][0] == system[0] and msgs[0]["content"][1]["text"].startswith("\n\nYou are a function")
    assert system == [{"type": "text", "text": "Be brief."}]  # the request's own message is left as it was


def test_history_calls_without_tools_are_written_in_the_parsers_format():
    p = tp.plan(None, None, tp.PARSERS["mistral"])
    assert p is not None and not p.parse and not p.tools
    call = {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    msgs, _ = tp.render_messages([{"role": "assistant", "content": "", "tool_calls": [call]}], p, native=False)
    assert msgs == [{"role": "assistant", "content": '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'}]


def test_openai_harmony_is_read_without_tools():
    """gpt-oss writes harmony channels whether or not the request has tools: analysis is reasoning, final is
    content, streamed or whole (the output decoded with its special tokens)."""
    from llmserve.serve_config import ServerSettings
    from llmserve.server.api.chat import ChatRendering
    from llmserve.server.rendering import ChoiceText
    from llmserve.server.state import ServerState

    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi.<|return|>"
    p = ServerState(ServerSettings(tool_call_parser="openai")).plan_tools(None, None)
    assert p.parse and p.keeps_specials and not p.tools
    t = ChoiceText.whole(text, None, p)
    assert (t.reasoning, t.calls()) == ("Think.", ("Hi.", []))
    r = ChatRendering(tokenizer=None, tool_plan=p)
    deltas = [c["delta"] for k in range(0, len(text), 5) for c in r.deltas(0, _output(text[k : k + 5]))]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Think."
    assert "".join(d.get("content", "") for d in deltas) == "Hi."
    assert not ServerState(ServerSettings(tool_call_parser="hermes")).plan_tools(None, None).parse


def _output(delta: str):
    from types import SimpleNamespace

    c = SimpleNamespace(
        text="", delta_text=delta, finish_reason=None, stop_reason=None, logprobs=None, delta_logprobs=None
    )
    return SimpleNamespace(outputs=[c], finished=False)


def _long_call(name: str, n: int) -> str:
    """A call to `write` whose text argument is n characters long, in the format of parser `name`."""
    body = ("word " * (n // 5 + 1))[:n]
    quoted = json.dumps(body)
    return {
        "hermes": '<tool_call>\n{"name": "write", "arguments": {"text": %s, "n": 1}}\n</tool_call>' % quoted,
        "llama3_json": '{"name": "write", "parameters": {"text": %s, "n": 1}}' % quoted,
        "mistral": '[TOOL_CALLS]write[ARGS]{"text": %s, "n": 1}' % quoted,
        "pythonic": "[write(text=%s, n=1)]" % quoted,
        "qwen3_coder": "<tool_call>\n<function=write>\n<parameter=text>\n%s\n</parameter>\n<parameter=n>\n1\n"
        "</parameter>\n</function>\n</tool_call>" % body,
        "openai": '<|channel|>commentary to=functions.write <|constrain|>json<|message|>{"text": %s, "n": 1}<|call|>'
        % quoted,
    }[name]


@pytest.mark.parametrize("name", list(tp.PARSERS))
def test_streaming_a_long_call_reads_its_text_once(name):
    """feed() is incremental: the scanners resume where they stopped, so the work per character of a call
    streamed in 4-character pieces stays the same from 5 kB to 50 kB (a re-scan of the region with every
    piece made it grow with the length: 0.06 s for 4 kB, minutes for 50 kB)."""
    write = {
        "type": "function",
        "function": {
            "name": "write",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}},
        },
    }
    per_char = []
    for n in (5_000, 50_000):
        text, s = _long_call(name, n), tp.PARSERS[name]([write]).stream()
        started = time.perf_counter()
        out = [d for k in range(0, len(text), 4) for d in s.feed(text[k : k + 4])] + s.flush()
        took = time.perf_counter() - started
        _, calls = tp.collect(out)
        assert json.loads(calls[0]["function"]["arguments"]) == {"text": ("word " * (n // 5 + 1))[:n], "n": 1}
        if name != "pythonic":  # the argument streamed as it came (pythonic sends each argument once it is whole)
            assert len([d for d in out if d.arguments]) > n // 100
        per_char.append(s.memo.work / len(text))
    assert per_char[1] < 1.5 * per_char[0], per_char
    assert took < 20, took  # a generous bound (a shared machine): the re-scan took over a minute (pythonic)
