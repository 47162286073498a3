"""`mistral`: Mistral and Mixtral instruct models. Calls follow the `[TOOL_CALLS]` token, a special token
(so these answers are decoded with skip_special_tokens off), as a JSON array of call objects (the v3
tokenizers)

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

or, from the v11 tokenizers on, as the name and its arguments object, one `[TOOL_CALLS]` per call:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Their ids are Mistral's: 9 letters and digits (the chat template refuses others)."""

from __future__ import annotations

import json
import re

import llmserve.server.tool_parsers.structure as S
from llmserve.server.tool_parsers.base import Memo, Partial, Scan, ToolParser, new_mistral_id
from llmserve.server.tool_parsers.jsonscan import Malformed, call_object, skip_ws, value_end

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(ToolParser):
    name = "mistral"
    starts = (TAG,)
    keep_special_tokens = True
    instructions = (
        "To call functions, answer with [TOOL_CALLS] and a JSON array of the calls, like this:\n"
        '[TOOL_CALLS] [{"name": <function-name>, "arguments": <arguments-json-object>}]'
    )

    def format_calls(self, calls: list[tuple[str, object]]) -> str:
        return TAG + " " + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def new_id(self) -> str:
        return new_mistral_id()

    def strict_format(self, calls: list[tuple[str, dict]]) -> dict:
        """After the tag: the array of call objects (v3) or NAME[ARGS]{...} (v11)."""
        objects = S.separated(
            [S.tag('{"name": %s, "arguments": ' % json.dumps(n), S.schema(s), "}") for n, s in calls], ", "
        )
        arrays = [S.tag(TAG + opening, objects, "]") for opening in ("[", " [")]
        named = [S.tag(TAG + n + ARGS, S.schema(s), "") for n, s in calls]
        return S.triggered([TAG], arrays + named)

    def region(self, buf: str, marker: str, final: bool, memo: Memo) -> Scan:
        j = skip_ws(buf, 0)
        if j >= len(buf):
            return Scan(end=len(buf), ok=False) if final else Scan()
        try:
            return self._array(buf, j, final, memo) if buf[j] == "[" else self._named(buf, j, final, memo)
        except Malformed:
            return Scan(end=len(buf), ok=False)

    def _array(self, buf: str, j: int, final: bool, memo: Memo) -> Scan:
        scan, j = Scan(), j + 1
        while True:
            j = skip_ws(buf, j)
            if j >= len(buf):
                break
            if buf[j] == "]":
                scan.end = j + 1
                scan.ok = bool(scan.calls) and all(self.known(p.name) for p in scan.calls)
                return scan
            if buf[j] == "," and scan.calls:
                j += 1
                continue
            if buf[j] != "{":
                raise Malformed("expected a call object")
            p, end = call_object(buf, j, final, memo)
            scan.calls.append(p)
            if end is None:
                break
            j = end
        if final:
            scan.end, scan.ok = len(buf), False
        return scan

    def _named(self, buf: str, j: int, final: bool, memo: Memo) -> Scan:
        m = _NAME.match(buf, j)
        if m is None:
            raise Malformed("expected a function name")
        k = skip_ws(buf, m.end())
        if k >= len(buf) or (buf[k] != "{" and ARGS.startswith(buf[k:])):
            return Scan(end=len(buf), ok=False) if final else Scan()
        if buf.startswith(ARGS, k):
            k = skip_ws(buf, k + len(ARGS))
            if k >= len(buf):
                return Scan(end=len(buf), ok=False) if final else Scan(calls=[Partial(name=m.group())])
        if buf[k] != "{":
            raise Malformed("expected the arguments object")
        p = Partial(name=m.group())
        end = value_end(buf, k, final, memo)
        p.args = buf[k:end] if end is not None else buf[k:]
        if end is None:
            return Scan(calls=[p], end=len(buf), ok=False) if final else Scan(calls=[p])
        try:
            ok = isinstance(json.loads(p.args), dict) and self.known(p.name)
        except json.JSONDecodeError:
            ok = False
        p.complete = True
        return Scan(calls=[p], end=end, ok=ok)
