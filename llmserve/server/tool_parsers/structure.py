"""The pieces of an xgrammar structural tag (its JSON form, compiled by llmserve.engine.guided), from which
each parser builds `strict_format`: the text stays free until the format's call opening, then the call
is held to a declared function and a strict tool's arguments to its schema.

Also `python_kwargs_grammar`: a JSON schema's object as Python keyword arguments (`a=1, b="x"`), an EBNF
grammar, for the pythonic format."""

from __future__ import annotations

import json


def const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def schema(s: dict | bool) -> dict:
    return {"type": "json_schema", "json_schema": s}


def regex(pattern: str) -> dict:
    return {"type": "regex", "pattern": pattern}


def grammar(ebnf: str) -> dict:
    return {"type": "grammar", "grammar": ebnf}


def any_text() -> dict:
    return {"type": "any_text"}


def seq(*elements: dict) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": list(elements)}


def either(*elements: dict) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


def tag(begin: str, content: dict, end: str | list[str]) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def triggered(triggers: list[str], tags: list[dict]) -> dict:
    """Free text; at a trigger, one of `tags` (a trigger must open each tag's begin); then free text again."""
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


def separated(tags: list[dict], separator: str) -> dict:
    """One or more of `tags`, `separator` between them."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True}


def structural_tag(fmt: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


# -- Python keyword arguments from a JSON schema (the pythonic format) ------------------------------
_STRING = r'("\"" ([^"\\\n] | "\\" [^\n])* "\"" | "\'" ([^\'\\\n] | "\\" [^\n])* "\'")'
_NUMBER = r'"-"? [0-9]+ ("." [0-9]+)? ([eE] [+-]? [0-9]+)?'
_INTEGER = r'"-"? [0-9]+'
# any Python literal (a value whose schema says nothing more): strings, numbers, constants, lists, dicts
_ANY = {
    "lit": 'str | num | "True" | "False" | "None" | "[" (lit (", " lit)*)? "]" | "{" (pair (", " pair)*)? "}"',
    "pair": 'lit ": " lit',
    "str": _STRING,
    "num": _NUMBER,
}


def _literal(value) -> str:
    """A JSON value as a Python literal's EBNF string."""
    if value is True or value is False or value is None:
        return json.dumps(repr(value))
    if isinstance(value, str):  # in either quotes
        quoted = {json.dumps(value, ensure_ascii=False), repr(value)}
        return "(" + " | ".join(json.dumps(q, ensure_ascii=False) for q in sorted(quoted)) + ")"
    return json.dumps(repr(value) if not isinstance(value, (list, dict)) else json.dumps(value))


class _Rules:
    def __init__(self) -> None:
        self.rules: dict[str, str] = dict(_ANY)

    def add(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, s) -> str:
        """The rule (or inline EBNF) of a value that follows schema `s`."""
        if not isinstance(s, dict):
            return "lit"
        if "const" in s:
            return _literal(s["const"])
        if isinstance(s.get("enum"), list) and s["enum"]:
            return "(" + " | ".join(_literal(v) for v in s["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                return "(" + " | ".join(self.value(x) for x in s[key]) + ")"
        kind = s.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**s, "type": k}) for k in kind) + ")"
        if kind == "string":
            return "str"
        if kind == "integer":
            return f"({_INTEGER})"
        if kind == "number":
            return "num"
        if kind == "boolean":
            return '("True" | "False")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self.value(s.get("items", {}))
            return self.add(f'"[" ({item} (", " {item})*)? "]"')
        if kind == "object" and isinstance(s.get("properties"), dict):
            return self.add('"{" ' + self.members(s, lambda k: _literal(k) + ' ": "') + ' "}"')
        return "lit"

    def members(self, s: dict, key) -> str:
        """An object's properties in the schema's order, the required ones always, the others optional,
        `, ` between; `key(name)` is the EBNF string that opens one."""
        props = list((s.get("properties") or {}).items())
        required = set(s.get("required") or [])
        rest = {}  # (index, started) -> rule: the properties from index on, after some (started) or none

        def from_(i: int, started: bool) -> str:
            if i == len(props):
                return '""'
            if (i, started) not in rest:
                name, sub = props[i]
                sep = '", " ' if started else ""
                item = f"{sep}{key(name)} {self.value(sub)} {from_(i + 1, True)}"
                body = item if name in required else f"{item} | {from_(i + 1, started)}"
                rest[(i, started)] = self.add(body)
            return rest[(i, started)]

        return from_(0, False)


def python_kwargs_grammar(s: dict) -> str:
    """EBNF (xgrammar's GBNF) for the keyword arguments of a call whose parameters follow JSON schema `s`."""
    r = _Rules()
    if not isinstance(s, dict) or not isinstance(s.get("properties"), dict):  # any keyword arguments
        root = r.add(r'([A-Za-z_] [A-Za-z0-9_]* "=" lit (", " [A-Za-z_] [A-Za-z0-9_]* "=" lit)*)?')
    else:
        root = r.members(s, lambda k: json.dumps(k + "="))
    lines = [f"root ::= {root}"] + [f"{name} ::= {body}" for name, body in r.rules.items()]
    return "\n".join(lines)
