"""The flags of `llmserve serve`, `run-batch`, `route` and `launch` (names, aliases, defaults, help, choices, types,
groups), and the settings they give when none is passed, against a snapshot (tests/data/cli_flags.json).
The engine's group is left out: test_config_flags.py checks it against EngineConfig.

A flag added or changed on purpose: rewrite the snapshot with
`python -m tests.unit.test_cli_flags --write` and review the diff."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SNAPSHOT = os.path.join(ROOT, "tests", "data", "cli_flags.json")
ENGINE_GROUP = "model and engine"


def _value(v):
    return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)


def parser_spec(add_arguments) -> list[dict]:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    group_of = {id(a): g.title for g in p._action_groups for a in g._group_actions}
    out = []
    for a in p._actions:
        if group_of.get(id(a)) == ENGINE_GROUP or isinstance(a, argparse._HelpAction):
            continue
        out.append(
            {
                "flags": list(a.option_strings),
                "dest": a.dest,
                "group": group_of.get(id(a)),
                "action": type(a).__name__,
                "default": _value(a.default),
                "help": a.help,
                "choices": None if a.choices is None else [_value(c) for c in a.choices],
                "type": getattr(a.type, "__name__", None),
                "nargs": a.nargs,
                "metavar": a.metavar,
                "const": _value(a.const),
            }
        )
    return out


def _settings_fields(obj, skip=("engine",)) -> dict:
    return {f.name: _value(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in skip}


def current() -> dict:
    from llmserve.router import cli as route_cli
    from llmserve.router import launch
    from llmserve.router.app import RouterConfig
    from llmserve.serve_config import serve_settings_from_args
    from llmserve.server import cli as serve_cli
    from llmserve.server import run_batch

    def parse(add_arguments, argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return p.parse_args(argv)

    return {
        "serve": parser_spec(serve_cli.add_arguments),
        "run-batch": parser_spec(run_batch.add_arguments),
        "route": parser_spec(route_cli.add_arguments),
        "launch": parser_spec(launch.add_arguments),
        # what no flags give
        "serve_settings": _settings_fields(serve_settings_from_args(parse(serve_cli.add_arguments, []))),
        "router_config": _settings_fields(
            route_cli.build_router(parse(route_cli.add_arguments, ["--backend", "http://127.0.0.1:1"])).config,
            skip=(),
        ),
        "router_config_class": _settings_fields(RouterConfig(), skip=()),
    }


def test_flags_and_their_settings_match_the_snapshot(monkeypatch):
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    with open(SNAPSHOT) as f:
        want = json.load(f)
    got = current()
    for key in want:
        assert got[key] == want[key], key
    assert set(got) == set(want)


def test_the_api_key_falls_back_to_its_variable(monkeypatch):
    from llmserve.serve_config import serve_settings_from_args
    from llmserve.server import cli as serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    monkeypatch.setenv("LLMSERVE_API_KEY", "from-env")
    assert serve_settings_from_args(p.parse_args([])).api_key == "from-env"
    assert serve_settings_from_args(p.parse_args(["--api-key", "flag"])).api_key == ["flag"]  # --api-key takes several


def test_the_router_and_the_launcher_build_their_flags_without_the_server():
    """The router and the server are peers: `llmserve route` and `launch` (which offers every serve flag)
    import nothing of llmserve.server."""
    code = """
import argparse, sys
from llmserve.router import cli, launch
for m in (cli, launch):
    m.add_arguments(argparse.ArgumentParser())
server = sorted(m for m in sys.modules if m.startswith("llmserve.server"))
assert not server, server
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


if __name__ == "__main__" and "--write" in sys.argv:
    os.environ.pop("LLMSERVE_API_KEY", None)
    with open(SNAPSHOT, "w") as f:
        json.dump(current(), f, indent=1, sort_keys=True)
        f.write("\n")
