"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 with JSON tool calling. The answer opens with one call object, or
several separated by `;`, optionally after `<|python_tag|>`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

("arguments" is read as well as "parameters"). An answer that does not open with `{` is text."""

from __future__ import annotations

import json

import llmserve.server.tool_parsers.structure as S
from llmserve.server.tool_parsers.base import Memo, Scan, ToolParser, opens_with
from llmserve.server.tool_parsers.jsonscan import Malformed, call_object, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    starts = (TAG,)
    instructions = (
        "To call a function, answer with only a JSON object of its name and parameters, like this:\n"
        '{"name": <function-name>, "parameters": <arguments-json-object>}\nSeparate several calls with "; ".'
    )

    def format_call(self, name: str, args) -> str:
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)

    def format_calls(self, calls: list[tuple[str, object]]) -> str:
        return "; ".join(self.format_call(n, a) for n, a in calls)

    def leading(self, text: str) -> int | None:
        return opens_with(text, "{", TAG)

    def strict_format(self, calls: list[tuple[str, dict]]) -> dict:
        """A leading list of calls (maybe after the tag), or text that does not open with one (a tag in it
        opens a call)."""
        tags = [S.tag('{"name": %s, "parameters": ' % json.dumps(n), S.schema(s), "}") for n, s in calls]
        listed = S.separated(tags, "; ")
        tagged = [dict(t, begin=TAG + t["begin"]) for t in tags]
        return S.either(
            S.seq(S.regex(r"\s*"), S.either(listed, S.seq(S.const(TAG), listed))),
            S.seq(S.regex(r"\s*([^{<\s]|<[^|])"), S.triggered([TAG], tagged)),
            S.regex(r"\s*"),
        )

    def region(self, buf: str, marker: str, final: bool, memo: Memo) -> Scan:
        scan, j = Scan(), skip_ws(buf, 0)
        while True:
            if j >= len(buf):
                if final:
                    scan.end, scan.ok = len(buf), bool(scan.calls) and scan.calls[-1].complete
                return scan
            if buf[j] != "{":
                scan.end, scan.ok = (len(buf), False) if not scan.calls else (j, scan.ok)
                return scan
            try:
                p, end = call_object(buf, j, final, memo)
            except Malformed:  # not a call: with the answer's end, the region is content
                return Scan(calls=scan.calls, end=len(buf), ok=False)
            scan.calls.append(p)
            if end is None:
                if final:
                    scan.end, scan.ok = len(buf), False
                return scan
            scan.ok = scan.ok and self.known(p.name)
            k = skip_ws(buf, end)
            if k >= len(buf):
                if final:
                    scan.end = len(buf)
                return scan
            if buf[k] != ";":
                scan.end = end
                return scan
            j = skip_ws(buf, k + 1)
