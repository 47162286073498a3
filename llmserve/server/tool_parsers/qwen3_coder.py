"""`qwen3_coder`: Qwen3-Coder (and Qwen3.5-style XML tool calling). Each call is XML in tags; the values
are raw text, read by the type the tool's schema gives the parameter (strings stay text; numbers,
booleans, objects and arrays are read as JSON, else Python literals, else text):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The arguments go out as a JSON object as they are written: a string parameter's text as it comes, the
others as each closes. A parameter left without
`</parameter>` ends at the next `<parameter=` or at `</function>`."""

from __future__ import annotations

import ast
import json
import re

import llmserve.server.tool_parsers.structure as S
from llmserve.server.tool_parsers.base import Memo, Partial, Scan, ToolParser, held

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNC = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>")
_ENDS = ("</parameter>", "<parameter=", "</function>")


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    starts = (OPEN,)
    instructions = (
        "To call a function, answer like this, one parameter element per argument:\n<tool_call>\n"
        "<function=function-name>\n<parameter=parameter-name>\nvalue\n</parameter>\n</function>\n</tool_call>"
    )

    def format_call(self, name: str, args) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in (args.items() if isinstance(args, dict) else ())
        )
        return f"{OPEN}\n<function={name}>\n{params}</function>\n{CLOSE}"

    def _kind(self, func: str, key: str):
        schema = ((self.functions.get(func) or {}).get("parameters") or {}).get("properties", {}).get(key) or {}
        return schema.get("type") if isinstance(schema, dict) else None

    def strict_format(self, calls: list[tuple[str, dict]]) -> dict:
        def params(s: dict) -> dict:
            return dict(S.schema(s), style="qwen_xml")

        opening = OPEN + "\n<function=%s>\n"
        return S.triggered([OPEN], [S.tag(opening % n, params(s), "</function>\n" + CLOSE) for n, s in calls])

    def _value(self, func: str, key: str, raw: str):
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        kind = self._kind(func, key)
        if kind == "string" or (isinstance(kind, list) and "string" in kind and raw.strip() not in ("null",)):
            return raw
        text = raw.strip()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return raw

    @staticmethod
    def _open_string(key: str, body: str, v: int, memo: Memo) -> str:
        """`"key": "text so far` of a string parameter still being written (from body[v]): its leading newline
        dropped, a trailing one (maybe the last, which is dropped) and what may be the start of an end tag
        held back. The text so far only grows: only what is new is encoded."""
        stop = len(body) - held(body, _ENDS)
        start = v + 1 if body.startswith("\n", v) else v
        stop = stop - 1 if stop > start and body[stop - 1] == "\n" else stop
        n, encoded = memo.state.get(("string", v), (start, ""))
        if stop > n:
            encoded += json.dumps(body[n:stop], ensure_ascii=False)[1:-1]
            memo.work += stop - n
            memo.state[("string", v)] = (stop, encoded)
        return json.dumps(key, ensure_ascii=False) + ': "' + encoded

    def region(self, buf: str, marker: str, final: bool, memo: Memo) -> Scan:
        close = memo.find(buf, CLOSE)
        body = buf[:close] if close >= 0 else buf
        bad = Scan(end=close + len(CLOSE) if close >= 0 else len(buf), ok=False)
        done = close >= 0 or final
        m = _FUNC.match(body)
        if m is None:
            if done or (body.strip() and not "<function=".startswith(body.strip()[:10])):
                return bad
            return Scan()
        p = Partial(name=m.group(1).strip(), args="{")
        args: list[str] = []
        j = m.end()
        while True:
            pm = _PARAM.match(body, j)
            if pm is None:
                break
            v = pm.end()
            hits = [(memo.find(body, e, v), e) for e in _ENDS]
            hits = [(at, e) for at, e in hits if at >= 0]
            if not hits:
                if not done:
                    if self._kind(p.name, pm.group(1).strip()) == "string":  # a string streams as it is written
                        p.args = "{" + ", ".join([*args, self._open_string(pm.group(1).strip(), body, v, memo)])
                    return Scan(calls=[p])
                hits = [(len(body), "")]
            at, e = min(hits)
            key = pm.group(1).strip()
            item = memo.state.get(("param", v, at))
            if item is None:  # read once: whole parameters are not read again
                memo.work += at - v
                try:
                    value = self._value(p.name, key, body[v:at])
                    item = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
                except TypeError:
                    return bad
                memo.state[("param", v, at)] = item
            args.append(item)
            p.args = "{" + ", ".join(args)
            j = at + len(e) if e == "</parameter>" else at
        rest = body[j:].strip()
        if rest.startswith("</function>") or (done and not rest):
            p.args, p.complete = "{" + ", ".join(args) + "}", True
            if close >= 0 or final:
                tail = rest[len("</function>") :].strip() if rest.startswith("</function>") else ""
                return Scan(calls=[p], end=bad.end, ok=not tail and self.known(p.name))
            return Scan(calls=[p])
        if done or (rest and not any(t.startswith(rest[: len(t)]) for t in ("<parameter=", "</function>"))):
            return Scan(calls=[p], end=bad.end, ok=False)
        return Scan(calls=[p])
