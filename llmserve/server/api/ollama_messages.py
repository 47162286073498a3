"""An Ollama request in the chat API's terms, for the chat machinery (prepare.chat_runs) to run: its messages as the
chat API's (`images`, bare base64, as image parts before the text; `tool_calls` with their arguments as a JSON
string), `think` as the chat template's enable_thinking. (Its `options` and `format`: ollama_options.py.)"""

from __future__ import annotations

import json

from llmserve.server import media
from llmserve.server import protocol as P
from llmserve.server.api.ollama_protocol import GeneratingRequest, OllamaMessage
from llmserve.server.errors import APIError
from llmserve.server.state import ServerState


def with_images(text: str, images: list[str] | None, where: str) -> str | list:
    """A content with Ollama's `images` (bare base64) as image parts before its text, where Ollama puts them."""
    return [*media.base64_image_parts(images, where), P.TextPart(text=text)] if images else text


def chat_messages(msgs: list[OllamaMessage]) -> list[P.ChatMessage]:
    out = []
    for k, m in enumerate(msgs):
        calls = None
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise APIError(400, f"messages[{k}].tool_calls[{j}]: needs a function with a name")
                args = f.get("arguments") or {}
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append(
                    {"id": f"call_{k}_{j}", "type": "function", "function": {"name": f["name"], "arguments": args}}
                )
        content = with_images(m.content or "", m.images, f"messages[{k}].images")
        out.append(P.ChatMessage(role=m.role, content=content, name=m.tool_name, tool_calls=calls))
    return out


def template_kwargs(state: ServerState, body: GeneratingRequest, model: str) -> dict | None:
    if body.think is None:
        return None
    if body.think and state.reasoning is None:
        raise APIError(
            400, f'"{model}" does not support thinking (this server runs without --reasoning-parser)', param="think"
        )
    return {"enable_thinking": bool(body.think)}
