"""Guided decoding with the bundled model: JSON schemas, json_object, choices, regexes and EBNF are
obeyed (streamed or not), bad schemas are ValueErrors naming the field, and constrained requests do
not change the greedy output of the free requests batched with them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llmserve import SamplingParams

S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -10, "maximum": 10},
                    "y": {"type": "integer", "minimum": -10, "maximum": 10},
                },
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {"city": S, "country": {"enum": ["FR", "DE", "US"]}},
        "required": ["city", "country"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "level": {"type": "string", "enum": ["low", "mid", "high"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["level", "score"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
            }
        },
        "required": ["user"],
    },
    {"type": "object", "properties": {"title": S, "done": {"type": "boolean"}}, "required": ["title", "done"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"]},
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["n"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "lang": {"enum": ["python", "rust", "go"]},
            "year": {"type": "integer", "minimum": 1990, "maximum": 2030},
        },
        "required": ["lang", "year"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": {"enum": [1, 2, 3]}}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {"type": "object", "properties": {"first": S, "last": S}, "required": ["first", "last"]},
    {
        "type": "object",
        "properties": {"size": {"enum": ["S", "M", "L"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["size", "qty"],
    },
    {
        "type": "object",
        "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
        "required": ["flags"],
    },
    {
        "type": "object",
        "properties": {"status": {"const": "ok"}, "code": {"type": "integer", "minimum": 200, "maximum": 599}},
        "required": ["status", "code"],
    },
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["word"]},
    {
        "type": "object",
        "properties": {
            "pair": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 2},
            "note": S,
        },
        "required": ["pair", "note"],
    },
]
assert len(SCHEMAS) == 20

MAX = 80


def _prompt(i):
    return [{"role": "user", "content": f"Reply with a JSON value for record {i}."}]


def _encode(llm, msgs):
    return llm.get_tokenizer().encode_chat(msgs)


def test_twenty_json_schemas_validate(llm):
    prompts = [_encode(llm, _prompt(i)) for i in range(len(SCHEMAS))]
    params = [SamplingParams(temperature=0, max_tokens=MAX, guided_json=s) for s in SCHEMAS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for s, o in zip(SCHEMAS, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (s, c.text)
        jsonschema.validate(json.loads(c.text), s)


def test_streamed_json_schema_validates(llm):
    """The engine's step outputs (what the server streams): deltas join into valid JSON."""
    eng = llm.engine
    ids = {}
    for i, s in enumerate(SCHEMAS[:4]):
        sp = SamplingParams(temperature=0.7, seed=i, max_tokens=MAX, guided_json=s)
        ids[eng.add_request(_encode(llm, _prompt(i)), sp, request_id=f"stream-{i}")] = s
    texts = {r: "" for r in ids}
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            texts[out.request_id] += out.outputs[0].delta_text
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    for r, s in ids.items():
        assert finals[r].finish_reason == "stop"
        assert texts[r] == finals[r].text
        jsonschema.validate(json.loads(texts[r]), s)


def test_json_object_choice_regex_grammar(llm):
    p = _encode(llm, [{"role": "user", "content": "Is the sky blue? Answer."}])
    choices = ["yes", "no", "it depends"]
    params = [
        SamplingParams(temperature=0, max_tokens=MAX, guided_json_object=True),
        SamplingParams(temperature=0, max_tokens=20, guided_choice=choices),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, guided_choice=choices),
        SamplingParams(temperature=0, max_tokens=20, guided_regex=r"[0-9]{3}-[a-z]{2,4}"),
        SamplingParams(temperature=0, max_tokens=20, guided_grammar='root ::= "ans: " ("A" | "B" | "C") "."'),
    ]
    o = [x.outputs[0] for x in llm.generate([p] * len(params), params, use_tqdm=False)]
    if o[0].finish_reason == "stop":  # a free-form object may run to max_tokens; then a prefix
        assert isinstance(json.loads(o[0].text), dict)
    else:
        assert o[0].text.startswith("{")
    assert o[1].text in choices and o[1].finish_reason == "stop"
    assert o[2].text in choices
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o[3].text), o[3].text
    assert re.fullmatch(r"ans: [ABC]\.", o[4].text), o[4].text


def test_mixed_batch_free_requests_unchanged(llm):
    free = [
        _encode(llm, [{"role": "user", "content": t}])
        for t in ("What is a hash table?", "Name three colors.", "Write a haiku about rain.")
    ]
    fp = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, fp, use_tqdm=False)]
    prompts, params = [], []
    for i, f in enumerate(free):
        prompts += [f, _encode(llm, _prompt(i))]
        params += [fp, SamplingParams(temperature=0, max_tokens=24, guided_json=SCHEMAS[i])]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [outs[2 * i].outputs[0].token_ids for i in range(len(free))] == alone


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"guided_json": {"type": "objekt"}}, "response_format"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "response_format"),
        ({"guided_json": "{not json"}, "response_format"),
        ({"guided_regex": "([a-z"}, "guided_regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ],
)
def test_bad_constraints_are_value_errors(llm, kw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        llm.generate("hi", SamplingParams(max_tokens=4, **kw), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_params_validation():
    with pytest.raises(ValueError, match="^guided_regex: only one"):
        SamplingParams(guided_json={"type": "object"}, guided_regex="a")
    with pytest.raises(ValueError, match="^guided_choice: "):
        SamplingParams(guided_choice=[])
    with pytest.raises(ValueError, match="^guided_choice: "):
        SamplingParams(guided_choice="yes")
    assert SamplingParams(guided_choice=("a", "b")).guided


def test_grammar_cache(llm):
    g = llm.engine.guided
    before = g.compilations
    for _ in range(3):
        g.compile(SamplingParams(guided_json=SCHEMAS[0]))
    g.compile(SamplingParams(guided_json=json.loads(json.dumps(SCHEMAS[0]))))
    assert g.compilations - before <= 1


STRICT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
        },
    },
}
FREE_TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
# (parser, answers with a strict call whose unit is %s, free text of that format)
STRICT_CALLS = [
    ("hermes", ['Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"unit": "%s"}}\n</tool_call>'],
     "Any text at all, {json} too."),
    ("llama3_json", ['{"name": "get_weather", "parameters": {"unit": "%s"}}; {"name": "get_time", "parameters": {}}',
                     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "%s"}}'],
     "It is {sunny} today."),
    ("mistral", ['Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"unit": "%s"}}]',
                 '[TOOL_CALLS]get_weather[ARGS]{"unit": "%s"}'], "Just [text]."),
    ("pythonic", ['[get_weather(city="Paris", unit="%s"), get_time(tz="UTC")]',
                  '<|python_start|>[get_weather(unit="%s")]<|python_end|>'], "Footnote [1] stays text."),
    ("qwen3_coder", ["Hm.<tool_call>\n<function=get_weather>\n<parameter=unit>%s</parameter>\n</function>\n"
                     "</tool_call>"],
     "free <b>text</b>"),
    ("openai", ["<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"unit": "%s"}<|call|>',
                '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"unit": "%s"}'
                "<|call|>"],
     "<|channel|>final<|message|>Hi.<|return|>"),
]  # fmt: skip


@pytest.mark.parametrize("name, calls, free", STRICT_CALLS, ids=[c[0] for c in STRICT_CALLS])
def test_strict_tools_are_held_in_every_format(llm, name, calls, free):
    """A strict tool under tool_choice auto, in each parser's format (tool_parsers.ToolPlan.strict_tag): the
    text is free until a call opens; from there the call must name a declared function and a strict tool's
    arguments must follow its schema; what the grammar lets through, the parser reads as the call."""
    from llmserve.server import tool_parsers

    plan = tool_parsers.plan([STRICT_WEATHER, FREE_TIME], "auto", tool_parsers.PARSERS[name])
    tag = plan.strict_tag()
    tok = llm.get_tokenizer()

    def accepts(text: str) -> bool:
        m = llm.engine.guided.matcher(SamplingParams(guided_structural_tag=tag))
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))

    assert accepts(free)
    for call in calls:
        assert accepts(call % "celsius"), call
        assert not accepts(call % "kelvin"), call  # the schema's enum
        assert not accepts(call.replace("get_weather", "launch_rockets") % "celsius"), call  # not a tool
        _, parsed = plan.parse_text(call % "celsius")
        assert parsed and json.loads(parsed[0]["function"]["arguments"])["unit"] == "celsius"
    free_only = dict(STRICT_WEATHER, function={**STRICT_WEATHER["function"], "strict": False})
    assert tool_parsers.plan([free_only], "auto", tool_parsers.PARSERS[name]).strict_tag() is None


def test_strict_pythonic_arguments_are_python_literals_by_the_schema(llm):
    """pythonic's strict calls: keyword arguments in the schema's order, the required ones present, each a
    Python literal of its type (True, None, either quotes, nested lists and dicts)."""
    from llmserve.server import tool_parsers

    props = {
        "a": {"type": "integer"},
        "b": {"type": "boolean"},
        "c": {"type": "array", "items": {"type": "string"}},
        "d": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": ["string", "null"]}}},
        "e": {"anyOf": [{"type": "integer"}, {"enum": ["auto"]}]},
        "z": {},
    }
    f = {"name": "f", "strict": True, "parameters": {"type": "object", "properties": props, "required": ["a"]}}
    plan = tool_parsers.plan([{"type": "function", "function": f}], "auto", tool_parsers.PARSERS["pythonic"])
    tag, tok = plan.strict_tag(), llm.get_tokenizer()

    def accepts(text: str) -> bool:
        m = llm.engine.guided.matcher(SamplingParams(guided_structural_tag=tag))
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))

    good = "[f(a=1, b=True, c=['x', \"y\"], d={'x': 1.5, \"y\": None}, e='auto', z=[1, {'k': None}])]"
    assert accepts(good) and accepts("[f(a=-2, e=3)]")
    args = {"a": 1, "b": True, "c": ["x", "y"], "d": {"x": 1.5, "y": None}, "e": "auto", "z": [1, {"k": None}]}
    assert json.loads(plan.parse_text(good)[1][0]["function"]["arguments"]) == args
    for bad in ("[f(b=True)]", "[f(a=1, b=true)]", "[f(a='1')]", "[f(a=1, e='manual')]", "[f(a=1, d={'y': 1})]"):
        assert not accepts(bad), bad


def test_json_schema_keeps_its_key_order(llm):
    """Properties come out in the order the schema lists them (not sorted: "zone" before "age" here)."""
    schema = {
        "type": "object",
        "properties": {"zone": {"enum": ["north"]}, "age": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["zone", "age"],
        "additionalProperties": False,
    }
    out = llm.generate(["Data:"], SamplingParams(temperature=0, max_tokens=40, guided_json=schema), use_tqdm=False)
    text = out[0].outputs[0].text
    assert list(json.loads(text)) == ["zone", "age"], text


def test_regex_no_token_can_spell_ends_the_request(llm):
    """A regex of characters no token of this vocabulary spells (found by the fuzz test: a 500 before): the
    request stops where nothing continues the grammar, and the engine keeps serving."""
    params = SamplingParams(temperature=0, max_tokens=8, guided_regex="q\u00ec\U0009ffed")
    out = llm.generate(["Say q:"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.startswith("q"), out
    assert llm.engine.kv.usage == 0
