"""`hermes`: Hermes, Qwen2.5 and Qwen3 (and the bundled model through the default tools prompt). Each call
is a JSON object in tags, anywhere in the answer:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

An answer that is one bare call object (`{"name": ..., "arguments": ...}`; what a forced tool_choice
makes the model write) is a call too; a tag left open at the end of the answer closes there."""

from __future__ import annotations

import json

import llmserve.server.tool_parsers.structure as S
from llmserve.server.tool_parsers.base import Memo, Scan, ToolParser
from llmserve.server.tool_parsers.jsonscan import Malformed, call_object, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    starts = (OPEN,)
    instructions = (
        "To call a function, answer with a JSON object of its name and arguments inside <tool_call></tool_call> "
        'tags, like this:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
    )

    def format_call(self, name: str, args) -> str:
        return OPEN + "\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n" + CLOSE

    def leading(self, text: str) -> int | None:
        return 0 if text.startswith("{") else None

    def strict_format(self, calls: list[tuple[str, dict]]) -> dict:
        opening = OPEN + '\n{"name": %s, "arguments": '
        return S.triggered([OPEN], [S.tag(opening % json.dumps(n), S.schema(s), "}\n" + CLOSE) for n, s in calls])

    def region(self, buf: str, marker: str, final: bool, memo: Memo) -> Scan:
        tagged = marker == OPEN
        j = skip_ws(buf, 0)
        close = memo.find(buf, CLOSE) if tagged else -1
        bad_end = close + len(CLOSE) if close >= 0 else (len(buf) if final else None)
        if j >= len(buf):
            return Scan(end=bad_end, ok=False)
        if buf[j] != "{":
            return Scan(end=bad_end, ok=False)
        try:
            p, end = call_object(buf, j, final, memo)
        except Malformed:
            return Scan(end=bad_end, ok=False)
        scan = Scan(calls=[p])
        if end is None:
            if close >= 0 or final:  # the tag closed (or the answer ended) inside the object
                return Scan(calls=[p], end=bad_end, ok=False)
            return scan
        scan.ok = self.known(p.name)
        if not tagged:
            scan.end = end
            return scan
        rest = skip_ws(buf, end)
        if buf.startswith(CLOSE, rest):
            scan.end = rest + len(CLOSE)
        elif rest < len(buf) and not CLOSE.startswith(buf[rest:]):
            scan.end, scan.ok = bad_end, False
        elif final:
            scan.end = len(buf)
        return scan
