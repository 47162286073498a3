"""`pythonic`: calls written as a Python list of calls with keyword arguments (Llama 3.2 / Llama 4 with
their pythonic system prompt, ToolACE, some Granite fine-tunes), opening the answer, optionally between
`<|python_start|>` and `<|python_end|>`:

    [get_weather(city="Paris", unit="celsius"), get_time(tz="UTC")]

The arguments are Python literals (strings, numbers, True / False / None, lists, dicts), sent as a JSON
object one argument at a time as each is written."""

from __future__ import annotations

import ast
import json
import re

import llmserve.server.tool_parsers.structure as S
from llmserve.server.tool_parsers.base import Memo, Partial, Scan, ToolParser, opens_with
from llmserve.server.tool_parsers.jsonscan import Malformed, skip_ws

START, END = "<|python_start|>", "<|python_end|>"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def literal_end(text: str, i: int, memo: Memo) -> int | None:
    """The index of the ',' or ')' that ends the Python literal starting at text[i] (None: not yet); read on
    from where the last call stopped."""
    depth, j, quote = memo.state.get(("literal", i), (0, i, None))
    frm = j
    memo.work += len(text) - frm
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return j if c == ")" else None
            depth -= 1
        elif c == "," and depth == 0:
            return j
        j += 1
    memo.state[("literal", i)] = (depth, j, quote)
    return None


class PythonicParser(ToolParser):
    name = "pythonic"
    instructions = (
        "To call functions, answer with only a Python list of the calls with keyword arguments, like this:\n"
        "[func_name1(param1=value1, param2=value2), func_name2(param=value)]"
    )

    def format_calls(self, calls: list[tuple[str, object]]) -> str:
        def kwargs(a) -> str:
            return ", ".join(f"{k}={v!r}" for k, v in a.items()) if isinstance(a, dict) else ""

        return "[" + ", ".join(f"{n}({kwargs(a)})" for n, a in calls) + "]"

    def leading(self, text: str) -> int | None:
        return opens_with(text, "[", START)

    def strict_format(self, calls: list[tuple[str, dict]]) -> dict:
        """A leading list of calls (maybe in the tags), their keyword arguments by the schema, or text that does
        not open with one."""
        tags = [S.tag(n + "(", S.grammar(S.python_kwargs_grammar(s)), ")") for n, s in calls]
        listed = S.seq(S.const("["), S.separated(tags, ", "), S.const("]"))
        return S.either(
            S.seq(S.regex(r"\s*"), S.either(listed, S.seq(S.const(START), listed, S.const(END)))),
            S.seq(S.regex(r"\s*([^\[<\s]|<[^|])"), S.any_text()),
            S.regex(r"\s*"),
        )

    def region(self, buf: str, marker: str, final: bool, memo: Memo) -> Scan:
        scan = Scan()
        try:
            done = self._list(buf, scan, memo)
        except (Malformed, ValueError, SyntaxError, TypeError):
            return Scan(calls=scan.calls, end=len(buf), ok=False)  # not a call list: content
        if done is None:
            if final:
                scan.end, scan.ok = len(buf), False
            return scan
        k = skip_ws(buf, done)
        if buf.startswith(END, k):
            done = k + len(END)
        elif marker == START and not final and END.startswith(buf[k:]):
            return Scan(calls=scan.calls)
        scan.end, scan.ok = done, all(self.known(p.name) for p in scan.calls)
        return scan

    def _list(self, buf: str, scan: Scan, memo: Memo) -> int | None:
        """Reads the list into scan.calls; the index after its ']', None while it is open."""
        j = skip_ws(buf, 0)
        if j >= len(buf):
            return None
        if buf[j] != "[":
            raise Malformed("expected '['")
        j += 1
        while True:
            j = skip_ws(buf, j)
            if j >= len(buf):
                return None
            if buf[j] == "]":
                if not scan.calls:
                    raise Malformed("no calls")
                return j + 1
            if buf[j] == "," and scan.calls and scan.calls[-1].complete:
                j += 1
                continue
            whole = memo.state.get(("call", j))  # a call read whole is not read again
            if whole is not None:
                scan.calls.append(whole[0])
                j = whole[1]
                continue
            j = self._call(buf, j, scan, memo)
            if j is None:
                return None

    def _call(self, buf: str, j: int, scan: Scan, memo: Memo) -> int | None:
        m = _IDENT.match(buf, j)
        if m is None:
            raise Malformed("expected a function name")
        if m.end() >= len(buf):
            return None
        if buf[m.end()] != "(":
            raise Malformed("expected '('")
        p = Partial(name=m.group(), args="{")
        scan.calls.append(p)
        args: list[str] = []
        start, j = j, m.end() + 1
        while True:
            j = skip_ws(buf, j)
            if j >= len(buf):
                return None
            if buf[j] == ")":
                p.args, p.complete = "{" + ", ".join(args) + "}", True
                memo.state[("call", start)] = (p, j + 1)
                return j + 1
            if buf[j] == "," and args:
                j += 1
                continue
            k = _IDENT.match(buf, j)
            if k is None:
                raise Malformed("expected an argument name")
            eq = skip_ws(buf, k.end())
            if eq >= len(buf):
                return None
            if buf[eq] != "=":
                raise Malformed("expected '='")
            v = skip_ws(buf, eq + 1)
            end = literal_end(buf, v, memo)
            if end is None:
                return None
            item = memo.state.get(("arg", v))
            if item is None:  # read once: whole arguments are not read again
                value = ast.literal_eval(buf[v:end].strip())
                item = json.dumps(k.group(), ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
                memo.state[("arg", v)] = item
                memo.work += end - v
            args.append(item)
            p.args = "{" + ", ".join(args)
            j = end
