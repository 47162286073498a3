"""`llmserve` command line: serve | run-batch | route | launch | bench | tune | chat | generate.

Each subcommand lives with the component it drives; this file only wires them together so that
`llmserve --help` stays fast (heavy modules are imported when a subcommand runs).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with `add_arguments(parser)` and `run(args) -> int | None`
SUBCOMMANDS = {
    "serve": ("llmserve.server.cli", "Serve a model over an OpenAI-compatible HTTP API"),
    "run-batch": ("llmserve.server.run_batch", "Run an OpenAI batch file (JSONL) through the server, offline"),
    "route": ("llmserve.router.cli", "Route OpenAI API requests over several servers"),
    "launch": ("llmserve.router.launch", "Start N servers and a router on this machine"),
    "bench": ("llmserve.bench.cli", "Load-test an OpenAI-compatible server"),
    "tune": ("llmserve.tune.cli", "Search the serve flags with the highest goodput under an SLO"),
    "generate": ("llmserve.engine.cli", "Generate text offline for one prompt"),
    "chat": ("llmserve.engine.cli_chat", "Chat with a model in the terminal (streaming)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        p.set_defaults(_module=module)
        if name == chosen:  # only the chosen subcommand pays for its imports
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    rc = importlib.import_module(args._module).run(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
