"""Command-line flags declared on dataclass fields: one source of truth for a setting and its flag.

A field's metadata (`flag(...)`: help, choices, aliases, group) makes its command-line flag;
`add_arguments(parser, cls)` adds a dataclass's flags to a parser and `from_args(cls, args)` builds the
dataclass back from the parsed arguments. A field without metadata has no flag (it is set from Python).
llmserve/config.py (engine, server) and llmserve/router/config.py (router) declare their settings so.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields

from llmserve import envs


def flag(
    help: str | None,
    *,
    choices: tuple | None = None,
    aliases: tuple[str, ...] = (),
    default=MISSING,
    group: str | None = None,
    action: str | None = None,
    type: typing.Any = None,
    metavar: str | None = None,
    name: str | None = None,
    parse: typing.Callable | None = None,
    env: str | None = None,
) -> dict:
    """A field's command-line flag (`--field-name`, or `name`, plus `aliases`), for `add_arguments`.

    `default`: the flag's, where it differs from the field's (the flag's spelling of the same setting);
    `group`: the --help group of this flag and the next ones (until one names another; before any does:
    the one `add_arguments` is given); `action`, `type`, `metavar`:
    argparse's, where the field's type does not say (a bool field is --x/--no-x, a list field takes
    several values, "extend" takes several values and may be given several times); `parse`: the flag's
    value -> the field's; `env`: the variable (llmserve/envs.py) an empty value falls back to."""
    return {
        "help": help,
        "choices": choices,
        "aliases": aliases,
        "default": default,
        "group": group,
        "action": action,
        "type": type,
        "metavar": metavar,
        "name": name,
        "parse": parse,
        "env": env,
    }


def add_arguments(parser: argparse.ArgumentParser, cls, group: str | None = None) -> None:
    """The flags of dataclass `cls`'s fields that have `flag` metadata, in field order, in their --help
    groups (`group`: the first one, unless the first field names one; None: the parser's own)."""
    groups: dict[str | None, typing.Any] = {None: parser}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        title = group = meta.get("group") or group
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        if meta["default"] is not MISSING:
            default = meta["default"]
        else:
            default = f.default_factory() if f.default_factory is not MISSING else f.default
        kwargs = {"default": default, "help": meta["help"]}
        kind = meta.get("type") or next(
            (t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name]
        )
        if meta.get("action"):
            kwargs["action"] = meta["action"]
            if meta["action"] == "extend":  # --api-key a b, --api-key a --api-key b
                kwargs["nargs"] = "+"
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:  # --lora-modules a=x b=y
            kwargs["nargs"] = "+"
        elif kind is not str:
            kwargs["type"] = kind
        if meta["choices"]:
            kwargs["choices"] = list(meta["choices"])
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if meta.get("name"):
            kwargs["dest"] = f.name
        option = meta.get("name") or "--" + f.name.replace("_", "-")
        groups[title].add_argument(option, *meta["aliases"], **kwargs)


def from_args(cls, args: argparse.Namespace, **values):
    """A `cls` from parsed arguments: each flagged field from its flag (through its `parse`; an empty value
    falls back to its `env`); `values` and the fields the arguments lack keep what they are given or their
    defaults."""
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta or f.name in values or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if meta.get("parse"):
            value = meta["parse"](value)
        if meta.get("env") and not value:
            value = getattr(envs, meta["env"])
        values[f.name] = value
    return cls(**values)


def comma_list(value: str | None) -> list[str]:
    """A comma-separated flag's items (a `parse` for list fields): blanks dropped."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]
