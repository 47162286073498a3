"""`llmserve chat`: an interactive terminal chat with streaming answers.

Commands: /reset clears the conversation, /exit (or Ctrl-D) quits.
"""

from __future__ import annotations

import sys

from llmserve.config import add_engine_arguments, engine_config_from_args


def add_arguments(p) -> None:
    from llmserve.engine.cli import add_sampling_arguments

    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(temperature=0.7, max_tokens=512)


def run(args) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    from llmserve.engine.cli import sampling_params_from_args, stream_one
    from llmserve.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    params = sampling_params_from_args(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    print(f"llmserve chat with {engine.served_model_name}. /reset clears, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": line})
        ids = engine.tokenizer.encode_chat(system + history)
        if len(ids) >= engine.max_model_len - 1:
            print("[the conversation is longer than the context; /reset it]", file=sys.stderr)
            history.pop()
            continue
        p = params.clone(max_tokens=min(params.max_tokens or 512, engine.max_model_len - len(ids)))
        try:
            answer = stream_one(engine, ids, p)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})
