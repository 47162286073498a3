"""`llmserve generate "prompt"`: one completion, offline, printed as it is generated."""

from __future__ import annotations

import argparse
import sys
import time

from llmserve.config import add_engine_arguments, engine_config_from_args


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt (use --raw to skip the chat template)")
    p.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(p)
    add_engine_arguments(p)


def sampling_params_from_args(args):
    from llmserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        stop=args.stop,
    )


def stream_one(engine, prompt_ids, params, out=sys.stdout) -> str:
    """Run one request on an LLMEngine, printing text as it comes; returns the text."""
    rid = engine.add_request(prompt_ids, params)
    text, t0, n, first = "", time.time(), 0, None
    while True:
        for o in engine.step():
            if o.request_id != rid:
                continue
            c = o.outputs[0]
            if c.delta_token_ids and first is None:
                first = time.time()
            n += len(c.delta_token_ids)
            out.write(c.delta_text)
            out.flush()
            text += c.delta_text
            if o.finished:
                dt = time.time() - t0
                rate = (n - 1) / (time.time() - first) if first and n > 1 and time.time() > first else 0.0
                print(
                    f"\n[{n} tokens, TTFT {(first or t0) - t0:.2f}s, {rate:.1f} tok/s, "
                    f"finish: {c.finish_reason}, {dt:.2f}s]",
                    file=sys.stderr,
                )
                return text


def run(args) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    from llmserve.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    if args.raw:
        ids = tok.encode(args.prompt)
    else:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        ids = tok.encode_chat(msgs)
    stream_one(engine, ids, sampling_params_from_args(args))
    return 0
