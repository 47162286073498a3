"""The traffic `llmserve tune` measures with: a dataset as `llmserve bench` takes it, or a request log replayed
with its timing.

A request log is JSONL, one request a line: `prompt` (text) or `messages` (chat), `max_tokens`, and `arrival`
(seconds from the log's start; `offset` and `t` are read too). It is checked when the tuner starts, before any
server does: a line that does not parse is an error naming the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmserve.bench.client import BenchRequest
from llmserve.bench.datasets import DatasetConfig, build_requests, parse_range

POOL = 128  # requests prepared once per run (then cycled): every candidate sees the same ones


@dataclass
class Workload:
    dataset: DatasetConfig | None = None  # bench's dataset, or
    log: list[BenchRequest] | None = None  # a request log (arrivals set)
    label: str = ""

    @property
    def replay(self) -> bool:
        return self.log is not None

    def native_rate(self) -> float:
        """A log's own requests per second (its count over its span)."""
        if not self.log:
            return 0.0
        span = (self.log[-1].arrival or 0.0) + 1.0
        return len(self.log) / span

    async def requests(self, tok) -> list[BenchRequest]:
        """The pool the probes draw from, token counts by `tok` (bench's tokenizer for the server)."""
        if self.log is not None:
            from llmserve.bench.datasets import count_tokens

            for r in self.log:
                r.prompt_len = await count_tokens(tok, r.prompt)
            return self.log
        return await build_requests(self.dataset, POOL, tok)


def from_args(args) -> Workload:
    """--workload FILE, else --dataset / --dataset-path / --input-len / --output-len; ValueError on bad input."""
    if args.workload:
        return Workload(log=read_log(args.workload), label=f"replay of {args.workload}")
    output = parse_range(args.output_len) if args.output_len else None
    if args.dataset in ("sharegpt", "prompts") and args.dataset_path and not Path(args.dataset_path).is_file():
        raise ValueError(f"--dataset-path: no file {args.dataset_path}")
    if args.dataset == "prompts" and not args.dataset_path:
        raise ValueError("--dataset prompts needs --dataset-path FILE (.txt or .jsonl)")
    cfg = DatasetConfig(args.dataset, args.dataset_path, parse_range(args.input_len), output, 256, args.seed)
    label = f"{args.dataset} dataset" + (f" ({args.dataset_path})" if args.dataset_path else "")
    if output:
        label += f", max_tokens {args.output_len}"
    return Workload(dataset=cfg, label=label)


def read_log(path: str) -> list[BenchRequest]:
    """A request log's requests in arrival order, the first at 0."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"--workload: cannot read {path}: {e.strerror}") from None
    out: list[BenchRequest] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
            msgs = obj.get("messages")
            prompt = obj.get("prompt")
            if msgs is not None and not (isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs)):
                raise ValueError("messages must be a list of objects")
            if prompt is None and not msgs:
                raise ValueError("needs prompt or messages")
            text = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in msgs or [])
            max_tokens = int(obj.get("max_tokens") or obj.get("max_completion_tokens") or 128)
            arrival = float(next((obj[k] for k in ("arrival", "offset", "t") if k in obj), 0.0))
            if max_tokens < 1 or arrival < 0:
                raise ValueError("max_tokens must be >= 1 and arrival >= 0")
        except (ValueError, TypeError) as e:
            raise ValueError(f"--workload: {path} line {n} does not parse: {e}") from None
        out.append(BenchRequest(prompt=text, prompt_len=0, output_len=max_tokens, messages=msgs, arrival=arrival))
    if not out:
        raise ValueError(f"--workload: no requests in {path}")
    out.sort(key=lambda r: r.arrival)
    t0 = out[0].arrival
    for r in out:
        r.arrival -= t0
    return out
