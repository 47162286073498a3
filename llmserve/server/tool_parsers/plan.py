"""A request's tools: the plan from `tools` / `tool_choice` / `parallel_tool_calls`, the tools rendered
into the prompt, forced calls as a grammar (the parsers of the model's output are this package's modules).

- Rendering: a model whose chat template knows `tools` gets them through the template; otherwise (the
  bundled SmolLM2) a default system prompt lists the functions as JSON schemas and asks for calls in the
  format of the parser in force (its `instructions`: hermes' `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, ...). Assistant messages that carry `tool_calls` are rendered in that same format
  (`format_calls`); `role: "tool"` results as `tool` turns.
- `tool_choice`: "none" renders no tools and parses nothing; "auto" (the default with tools) parses
  the calls in the model's format (the server's tool-call parser); "required" and a named function
  constrain the output with a JSON schema (anyOf over the functions, or the one named), so the
  output is always exactly one call object, read by the hermes parser (its bare-object form).
- `parallel_tool_calls: false`: only the first call is kept.
- `response_format` with a required or named call: the call wins (the format is for a text answer).
- `strict: true` tools under "auto": the text is free until a call opens in the parser's format, then the
  grammar holds the call to a function's name and its arguments to its schema (an xgrammar structural tag
  each parser builds: `strict_format`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmserve.server.tool_parsers.hermes import HermesParser
from llmserve.server.tool_parsers.structure import structural_tag

# the default tools prompt, followed by the parser's `instructions` (how to call, in its format)
DEFAULT_TOOLS_PROMPT = (
    "You are a function calling AI model. You may call one or more of the functions below to help "
    "with the user's request. Here are the available functions, as JSON schemas:\n<tools>\n{tools}\n"
    "</tools>\n"
)


class ToolError(ValueError):
    pass


@dataclass
class ToolPlan:
    tools: list[dict]  # OpenAI tool objects (type function)
    choice: str  # "auto", "none", "required" or "function"
    name: str | None = None  # the function tool_choice names
    forced_schema: dict | None = None
    parser: type | None = None  # the server's ToolParser class (hermes when None)
    parallel: bool = True  # parallel_tool_calls

    @property
    def parse(self) -> bool:
        """The output is read for calls: tools to call, or a format read with or without them (harmony)."""
        always = not self.forced and self.parser is not None and self.parser.always
        return (self.choice != "none" and bool(self.tools)) or always

    @property
    def forced(self) -> bool:
        return self.forced_schema is not None

    @property
    def keeps_specials(self) -> bool:
        """The calls' markers are special tokens (mistral, openai): the output is decoded with them."""
        return self.parse and not self.forced and self.parser is not None and self.parser.keep_special_tokens

    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def new_parser(self):
        """The ToolParser that reads this request's output: a forced call is one bare call object (hermes)."""
        cls = HermesParser if self.forced or self.parser is None else self.parser
        return cls(self.tools)

    def stream(self):
        """A ToolStream over this request's output (one per choice)."""
        return self.new_parser().stream(None if self.parallel else 1)

    def strict_tag(self) -> str | None:
        """With a `strict: true` tool under tool_choice auto: the structural tag, in the parser's format, that
        leaves the text free until a call opens, then holds the call to a declared function and its arguments
        to its parameters (the others' to any object); None otherwise."""
        fs = [t["function"] for t in self.tools]
        if self.choice != "auto" or not any(f.get("strict") for f in fs):
            return None
        calls = [
            (f["name"], (f.get("parameters") or {"type": "object"}) if f.get("strict") else {"type": "object"})
            for f in fs
        ]
        return structural_tag(self.new_parser().strict_format(calls))

    def parse_text(self, text: str) -> tuple[str | None, list[dict]]:
        return self.new_parser().parse(text, None if self.parallel else 1)


def _function(t: Any) -> dict:
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
        raise ToolError('tools: each tool must be {"type": "function", "function": {...}}')
    f = t["function"]
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise ToolError("tools: each function needs a name")
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ToolError(f"tools: the parameters of {f['name']!r} must be a JSON schema object")
    return f


def plan(tools: list[dict] | None, tool_choice: Any, parser: type | None = None, parallel=None) -> ToolPlan | None:
    """Validate tools and tool_choice. `parser`: the ToolParser class of the model's format; `parallel`: the
    request's parallel_tool_calls (None: true). Without tools: None, or with a parser, a plan without tools
    (choice "none") that renders history calls in its format and reads a format that is always read."""
    p = _plan(tools, tool_choice)
    if p is None and parser is not None:
        p = ToolPlan([], "none")
    if p is not None:
        p.parser, p.parallel = parser, parallel is not False
    return p


def _plan(tools: list[dict] | None, tool_choice: Any) -> ToolPlan | None:
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice: requires tools")
        return None
    funcs = [_function(t) for t in tools]
    names = [f["name"] for f in funcs]
    if len(set(names)) != len(names):
        raise ToolError("tools: function names must be unique")
    tools = [{"type": "function", "function": f} for f in funcs]
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(tools, "auto")
    if tool_choice == "none":
        return ToolPlan(tools, "none")

    def call_schema(f: dict) -> dict:
        params = f.get("parameters") or {"type": "object", "properties": {}}
        return {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    if tool_choice == "required":
        schemas = [call_schema(f) for f in funcs]
        return ToolPlan(tools, "required", forced_schema=schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    if isinstance(tool_choice, dict):
        is_function = tool_choice.get("type", "function") == "function"
        name = (tool_choice.get("function") or {}).get("name") if is_function else None
        if not name:
            raise ToolError(
                'tool_choice: must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
            )
        if name not in names:
            raise ToolError(f"tool_choice: function {name!r} is not among the tools ({', '.join(names)})")
        f = funcs[names.index(name)]
        return ToolPlan(tools, "function", name=name, forced_schema=call_schema(f))
    raise ToolError(f'tool_choice: must be "auto", "none", "required" or a named function, got {tool_choice!r}')


def template_supports_tools(tokenizer) -> bool:
    tpl = getattr(tokenizer.hf, "chat_template", None) or ""
    return isinstance(tpl, str) and "tools" in tpl


def render_messages(msgs: list[dict], p: ToolPlan | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """Messages (and the `tools` argument for the template) ready for apply_chat_template. A content may be
    a list of parts (a vision-language model's chat: text and image parts): the calls and the tools prompt go
    in as text parts, and an added system message is parts too where the others are."""
    if native:
        return msgs, (p.tools if p is not None and p.choice != "none" and p.tools else None)
    fmt = (p.parser if p is not None and p.parser is not None else HermesParser)(p.tools if p is not None else [])
    parts = any(isinstance(m.get("content"), list) for m in msgs)
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = [] if parts else ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = c.get("function", {}) if isinstance(c, dict) else {}
                args = f.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                calls.append((f.get("name"), args))
            m["content"] = _with_text(m.get("content"), fmt.format_calls(calls), "")
            m.pop("tool_calls")
        out.append(m)
    if p is not None and p.choice != "none" and p.tools:
        text = (
            DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in p.tools))
            + fmt.instructions
        )
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = dict(out[0], content=_with_text(out[0]["content"], text, "\n\n"))
        else:
            out.insert(0, {"role": "system", "content": [{"type": "text", "text": text}] if parts else text})
    return out, None


def _with_text(content: str | list[dict] | None, text: str, sep: str) -> str | list[dict]:
    """`text` added after a message's content: joined to a string (by `sep`, stripped), a text part after parts."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": sep + text if content else text}]
    return ((content or "") + sep + text).strip()


def guided_kwargs(body, p: ToolPlan | None = None) -> dict:
    """SamplingParams' guided_* fields from a request body: OpenAI's `response_format`, vLLM's
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and a forced tool call."""
    kw: dict[str, Any] = {}
    rf = getattr(body, "response_format", None)
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            kw["guided_json_object"] = True
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    'response_format: {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": {...}}'
                )
            kw["guided_json"] = schema
        elif kind != "text":
            raise ValueError(f'response_format: type must be "text", "json_object" or "json_schema", got {kind!r}')
    if p is not None and p.forced:
        # response_format shapes a text answer, and a forced call has none: the call wins, as OpenAI's API
        # has it (openai-agents sends both: an Agent's output_type with ModelSettings.tool_choice)
        kw = {}
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        v = getattr(body, name, None)
        if v is not None:
            if kw:
                raise ValueError(f"{name}: only one of response_format and guided_* per request")
            kw[name] = v
    if p is not None and p.forced:
        if kw:
            raise ValueError("tool_choice: a required or named tool call cannot be combined with guided_*")
        # as text: the engine's grammar keeps a text schema's key order (a dict's keys are sorted), and the
        # call's name must come before its arguments for the arguments to stream under their name
        kw["guided_json"] = json.dumps(p.forced_schema)
    elif p is not None and not kw and (tag := p.strict_tag()) is not None:
        kw["guided_structural_tag"] = tag
    return kw
