"""`llmserve run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through the server's own
app, in this process, with no HTTP port (vLLM's `vllm run-batch`).

The app is built as `llmserve serve` builds it (every engine and server flag applies: --max-num-seqs,
--chat-template, --reasoning-parser, ...), started (the model loads) and called in the process for each
line (llmserve/server/batch.py), up to --max-num-seqs lines at a time so that they share the engine's
steps. The output holds one result line per request line, in the input's order; `-` reads stdin or
writes stdout. Exit status 0 once every line has a result (failed requests included), 1 when the model
cannot load or the input cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys

from llmserve.config import add_serve_arguments, flag_dests, serve_settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-i", "--input-file", required=True, help="the batch file (OpenAI's JSONL batch input format); - for stdin"
    )
    parser.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="where the result lines go (OpenAI's batch output format); - for stdout",
    )
    add_serve_arguments(parser)


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write(path: str, results: list[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


async def run_file(settings, text: str) -> list[dict]:
    """The result lines of a batch file's `text`, in its order, through an app built from `settings`."""
    from tqdm import tqdm

    from llmserve.server.app import build_app
    from llmserve.server.batch import in_process_client, parse_lines, run_lines, running_app

    lines = parse_lines(text)
    app = build_app(settings, load_in_background=False)
    state = app.state.llm
    async with running_app(app):
        if state.engine is None:
            raise SystemExit(f"llmserve run-batch: the model failed to load: {state.load_error}")
        with tqdm(total=len(lines), desc="requests", unit="req", file=sys.stderr) as bar:
            async with in_process_client(app, state.api_keys) as client:
                results = await run_lines(
                    client, lines, settings.engine.max_num_seqs, on_result=lambda _line, _r: bar.update(1)
                )
    return [results[line.index] for line in lines]


def run(args: argparse.Namespace) -> int:
    from llmserve.server.batch import succeeded
    from llmserve.server.cli import _apply_config_file

    _apply_config_file(args, flag_dests(sys.argv[2:]))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per in-process call: the bar says enough
    try:
        text = _read(args.input_file)
    except OSError as e:
        print(f"llmserve run-batch: cannot read {args.input_file}: {e}", file=sys.stderr)
        return 1
    try:
        settings = dataclasses.replace(serve_settings_from_args(args), batch_dir=None)  # no Batches API here
        results = asyncio.run(run_file(settings, text))
    except ValueError as e:  # a bad setting (as `llmserve serve` refuses it)
        raise SystemExit(f"llmserve run-batch: {e}") from e
    _write(args.output_file, results)
    ok = sum(succeeded(r) for r in results)
    print(f"llmserve run-batch: {len(results)} requests, {ok} succeeded, {len(results) - ok} failed", file=sys.stderr)
    return 0
