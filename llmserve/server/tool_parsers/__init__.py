"""Tool calling for every chat-shaped API (chat completions, Responses, Messages).

- plan.py: a request's tools and tool_choice (validated), rendered into the prompt, forced by a grammar;
- base.py: the parsers' one interface (ToolParser: `parse(text)`, `stream()` whose `feed(delta)` gives
  content deltas, then per call its id and name once and its arguments as they are written) and the
  streaming machine they share;
- one module per model format, named as vLLM names them (`--tool-call-parser`): hermes, llama3_json,
  mistral, openai (gpt-oss harmony), pythonic, qwen3_coder.

Without `--tool-call-parser` the parser is chosen from the chat template's text (`choose`).
"""

from __future__ import annotations

from llmserve.server.tool_parsers.base import ToolDelta, ToolParser, collect, openai_delta
from llmserve.server.tool_parsers.hermes import HermesParser
from llmserve.server.tool_parsers.llama3_json import Llama3JsonParser
from llmserve.server.tool_parsers.mistral import MistralParser
from llmserve.server.tool_parsers.openai import OpenAIParser
from llmserve.server.tool_parsers.plan import (
    DEFAULT_TOOLS_PROMPT,
    ToolError,
    ToolPlan,
    guided_kwargs,
    plan,
    render_messages,
    template_supports_tools,
)
from llmserve.server.tool_parsers.pythonic import PythonicParser
from llmserve.server.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    c.name: c for c in (HermesParser, Llama3JsonParser, MistralParser, OpenAIParser, PythonicParser, Qwen3CoderParser)
}

# (what the chat template's text holds, the parser): the first that matches wins
_TEMPLATE_HINTS = (
    ("<|channel|>", OpenAIParser),
    ("<function=", Qwen3CoderParser),
    ("<tool_call>", HermesParser),
    ("[TOOL_CALLS]", MistralParser),
    ("<|python_start|>", PythonicParser),
    ("<|python_tag|>", Llama3JsonParser),
    ('"parameters": dictionary of argument name and its value', Llama3JsonParser),
)


def get_parser(name: str) -> type[ToolParser]:
    """The parser --tool-call-parser names; a ValueError naming the choices for any other name."""
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; choose from {', '.join(PARSERS)}")
    return PARSERS[name]


def choose(template: str | None) -> type[ToolParser]:
    """The parser for a chat template's format, from the markers its text holds; hermes (the format the
    default tools prompt asks for) when it holds none."""
    for hint, cls in _TEMPLATE_HINTS:
        if template and hint in template:
            return cls
    return HermesParser


__all__ = [
    "DEFAULT_TOOLS_PROMPT",
    "PARSERS",
    "ToolDelta",
    "ToolError",
    "ToolParser",
    "ToolPlan",
    "choose",
    "collect",
    "get_parser",
    "guided_kwargs",
    "openai_delta",
    "plan",
    "render_messages",
    "template_supports_tools",
]
