"""`llmserve run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through the server's own
app, in this process, with no HTTP port (vLLM's `vllm run-batch`).

The app is built as `llmserve serve` builds it (every engine and server flag applies: --max-num-seqs,
--chat-template, --reasoning-parser, ...), started (the model loads) and called in the process for each
line (llmserve/server/batch.py), up to --max-num-seqs lines at a time so that they share the engine's
steps. The output holds one result line per request line, in the input's order; `-` reads stdin or
writes stdout. Exit status 0 once every line has a result (failed requests included), 1 when the model
cannot load or the input cannot be read.

Resumable: with an output file (not `-`), each result is also appended to OUTPUT.partial as it comes. A
run that is stopped (Ctrl-C, a crash, a killed machine) leaves that file; the same command again sends
only the lines it has no answer for (a line whose custom_id changed since, or whose answer was a server
error, 5xx, is sent again), then writes OUTPUT whole and removes OUTPUT.partial.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys

from llmserve.config import flag_dests
from llmserve.serve_config import add_serve_arguments, serve_settings_from_args


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


def partial_path(output_file: str) -> str | None:
    """Where a run's results so far are kept (None for stdout: such a run cannot be resumed)."""
    return None if output_file == "-" else output_file + ".partial"


def _kept(line, result: dict | None) -> bool:
    """Whether a recorded `result` still answers `line`: the same custom_id, and no server error."""
    if result is None or result.get("custom_id") != line.custom_id:
        return False
    status = (result.get("response") or {}).get("status_code")
    return status is None or status < 500


async def run_file(settings, text: str, partial: str | None = None) -> list[dict]:
    """The result lines of a batch file's `text`, in its order, through an app built from `settings`.
    `partial`: a file of results so far (read_partial's format): lines it answers are not sent again, and
    each new result is appended to it."""
    from contextlib import nullcontext

    from tqdm import tqdm

    from llmserve.server.app import build_app
    from llmserve.server.batch import (
        in_process_client,
        parse_lines,
        read_partial,
        record_partial,
        run_lines,
        running_app,
    )

    lines = parse_lines(text)
    recorded = read_partial(partial) if partial else {}
    results = {line.index: recorded[line.index] for line in lines if _kept(line, recorded.get(line.index))}
    todo = [line for line in lines if line.index not in results]
    if results:
        msg = f"llmserve run-batch: resuming: {len(results)} of {len(lines)} lines answered in {partial}"
        print(msg, file=sys.stderr)
    if todo:
        app = build_app(settings, load_in_background=False)
        state = app.state.llm
        async with running_app(app):
            if state.engine is None:
                raise SystemExit(f"llmserve run-batch: the model failed to load: {state.load_error}")
            bar = tqdm(total=len(lines), initial=len(results), desc="requests", unit="req", file=sys.stderr)
            with bar, open(partial, "a", encoding="utf-8") if partial else nullcontext() as f:

                def record(line, result) -> None:
                    if f is not None:
                        record_partial(f, line, result)
                    bar.update(1)

                async with in_process_client(app, state.api_keys) as client:
                    results.update(await run_lines(client, todo, settings.engine.max_num_seqs, on_result=record))
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
        partial = partial_path(args.output_file)
        results = asyncio.run(run_file(settings, text, partial))
    except ValueError as e:  # a bad setting (as `llmserve serve` refuses it)
        raise SystemExit(f"llmserve run-batch: {e}") from e
    except KeyboardInterrupt:
        if partial:
            print(f"llmserve run-batch: stopped; the same command resumes from {partial}", file=sys.stderr)
        return 130
    _write(args.output_file, results)
    if partial and os.path.exists(partial):
        os.remove(partial)
    ok = sum(succeeded(r) for r in results)
    print(f"llmserve run-batch: {len(results)} requests, {ok} succeeded, {len(results) - ok} failed", file=sys.stderr)
    return 0
