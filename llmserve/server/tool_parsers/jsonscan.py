"""Reading JSON as it is written: where a value ends (or that it has not yet), and a call object
`{"name": ..., "arguments": {...}}` (or "parameters") read key by key, its arguments' text growing, for
the parsers whose calls are JSON (hermes, llama3_json, mistral)."""

from __future__ import annotations

import json
import re

from llmserve.server.tool_parsers.base import Memo, Partial

_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")
_WS = " \t\r\n"
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # a string's characters up to its closing quote
_PLAIN = re.compile(r'[^"{}\[\]]+')  # inside an object or array: a run of nothing that opens or closes


class Malformed(ValueError):
    pass


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int, memo: Memo | None = None) -> int | None:
    """The index after the JSON string that opens at text[i] ('"'), None if it is not closed yet. With a
    memo, an open string is read on from where the last call stopped."""
    frm = i + 1 if memo is None else memo.state.get(("str", i), i + 1)
    j = _STRING_BODY.match(text, frm).end()  # whole characters and escapes: a trailing backslash waits
    if memo is not None:
        memo.work += j - frm + 1
        memo.state[("str", i)] = j
    return j + 1 if j < len(text) and text[j] == '"' else None


def value_end(text: str, i: int, final: bool = False, memo: Memo | None = None) -> int | None:
    """The index after the JSON value that starts at text[i], None if it is not whole yet. Raises
    Malformed for what cannot start or continue a value. With a memo, an open object or array is read on
    from where the last call stopped."""
    c = text[i]
    if c == '"':
        return string_end(text, i, memo)
    if c in "{[":
        key = ("value", i)
        depth, j = (0, i) if memo is None else memo.state.get(key, (0, i))
        if isinstance(depth, str):  # read whole before
            return j
        frm = j
        while j < len(text):
            m = _PLAIN.match(text, j)
            if m is not None:
                j = m.end()
                continue
            c = text[j]
            if c == '"':
                e = string_end(text, j, memo)
                if e is None:
                    break
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    if memo is not None:
                        memo.work += j + 1 - frm
                        memo.state[key] = ("whole", j + 1)
                    return j + 1
            j += 1
        if memo is not None:
            memo.work += j - frm
            memo.state[key] = (depth, j)
        return None
    m = _SCALAR.match(text, i)
    if m is None:
        if "true".startswith(text[i:]) or "false".startswith(text[i:]) or "null".startswith(text[i:]):
            return None
        raise Malformed(f"not a JSON value at {text[i : i + 20]!r}")
    return m.end() if m.end() < len(text) or final else None


def call_object(text: str, i: int, final: bool = False, memo: Memo | None = None) -> tuple[Partial, int | None]:
    """The call object that opens at text[i] ('{'): the call so far, and the index after the object (None
    while it is open). Its arguments stream as their raw text when they are an object; a string of JSON
    (some models quote them) goes out whole, decoded, once it ends. Raises Malformed. With a memo, a call
    read whole before is not read again, and its open arguments are read on from where they stopped."""
    whole = None if memo is None else memo.state.get(("call", i))
    if whole is not None:
        return whole
    p, j, args_raw = Partial(), i + 1, None
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return p, None
        c = text[j]
        if c == "}":
            break
        if c == ",":
            j += 1
            continue
        if c != '"':
            raise Malformed(f"expected a key at {text[j : j + 20]!r}")
        k_end = string_end(text, j, memo)
        if k_end is None:
            return p, None
        key = json.loads(text[j:k_end])
        j = skip_ws(text, k_end)
        if j >= len(text):
            return p, None
        if text[j] != ":":
            raise Malformed(f"expected ':' after the key {key!r}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return p, None
        v_end = value_end(text, j, final, memo)
        is_args = key in ("arguments", "parameters") and args_raw is None
        if is_args and text[j] == "{":
            p.args = text[j:] if v_end is None else text[j:v_end]
        if v_end is None:
            return p, None
        value = text[j:v_end]
        if key == "name":
            p.name = json.loads(value)
        elif is_args:
            args_raw = value
        j = v_end
    end = j + 1
    try:
        json.loads(text[i:end])
        args = json.loads(args_raw) if args_raw is not None else {}
        if isinstance(args, str):
            p.args = args
            args = json.loads(args)
    except json.JSONDecodeError as e:
        raise Malformed(str(e)) from e
    if not isinstance(args, dict) or not isinstance(p.name, str):
        raise Malformed("a call needs a name and an arguments object")
    if args_raw is None:
        p.args = "{}"
    p.complete = True
    if memo is not None:
        memo.work += end - i  # read whole once more (json.loads)
        memo.state[("call", i)] = (p, end)
    return p, end
