"""Schemathesis against a live `llmserve serve` (issue #55): every operation of /openapi.json, positive and
negative cases drawn by hypothesis, each sent with the API key and without it, every answer checked by
schemathesis' not_a_server_error, status_code_conformance and content_type_conformance (every status and
content type declared for its operation), and response_schema_conformance on 2xx JSON. Generated bodies get a
token budget of --max-tokens (llmserve.testing.fuzz.clamp_budget: a 2-core CPU answers a few tokens a second
under this load). Outside CI: its figures go into docs/reliability.md; tests/e2e/test_fuzz.py is the short run.

    python -m benchmarks.serving.fuzz_schemathesis [--examples 60] [--max-time 900] [--port 18120] [--max-tokens 2]

Each operation gets its share of the time left (an operation that ends early leaves its rest to the next).

Prints the operations, requests, answers by status class and each check's failures (with one example each);
exits 1 on any failure."""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import tempfile
import time

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmserve.server.openapi import STREAMED
from llmserve.testing.fuzz import clamp_budget
from llmserve.testing.launcher import ServerProcess

KEY = "fuzz-key"
H = {"Authorization": f"Bearer {KEY}"}
CHECKS = (not_a_server_error, status_code_conformance, content_type_conformance)


class Tally:
    def __init__(self) -> None:
        self.requests = 0
        self.answers: collections.Counter = collections.Counter()  # "2xx", "4xx", ...
        self.media: collections.Counter = collections.Counter()  # content types of 200s
        self.failures: dict[str, list[str]] = collections.defaultdict(list)  # check -> examples

    def check(self, case, resp, checks) -> None:
        self.requests += 1
        self.answers[f"{resp.status_code // 100}xx"] += 1
        ctype = resp.headers.get("content-type") or ""
        ctype = (ctype[0] if isinstance(ctype, list) else ctype).split(";")[0]
        if resp.status_code == 200:
            self.media[ctype] += 1
        for check in checks:
            try:
                case.validate_response(resp, checks=[check])
            except Exception as e:  # noqa: BLE001 - every failure counted under its check
                self.failures[check.__name__].append(f"{case.method.upper()} {case.path} {resp.status_code}: {e}"[:300])


def run_operation(op, url: str, tally: Tally, examples: int, deadline: float, max_tokens: int) -> None:
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        if time.time() > deadline:
            return

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            if time.time() > deadline:
                return
            if not isinstance(case.body, schemathesis.core.NotSet):
                clamp_budget(case.body, case.path, max_tokens)
            resp = case.call(base_url=url, headers=H, timeout=300)
            ctype = resp.headers.get("content-type") or ""
            ctype = ctype[0] if isinstance(ctype, list) else ctype
            extra = (response_schema_conformance,) if resp.status_code < 300 and "json" in ctype else ()
            tally.check(case, resp, CHECKS + extra)
            tally.check(case, case.call(base_url=url, headers={}, timeout=300), CHECKS)
            if case.path in STREAMED and isinstance(case.body, dict) and case.body.get("stream") is not True:
                case.body["stream"] = True  # the same body streamed: SSE or NDJSON, declared too
                tally.check(case, case.call(base_url=url, headers=H, timeout=300), CHECKS)

        try:
            run()
        except Unsatisfiable:
            pass  # an operation without parameters or body has no negative cases
        except Exception as e:  # noqa: BLE001 - a case that could not be sent: reported, the run goes on
            tally.failures["client"].append(f"{op.method.upper()} {op.path}: {e!r}"[:300])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.machine()
    return f"{name}, {os.cpu_count()} CPUs"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=60, help="generated cases per operation and mode")
    ap.add_argument("--max-time", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--max-tokens", type=int, default=2, help="token budget of a generated body")
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    batches = tempfile.mkdtemp(prefix="fuzz-batches-")
    flags = ("--api-key", KEY, "--max-model-len", "256", "--max-num-seqs", "32", "--request-timeout", "120")
    with ServerProcess(*flags, "--batch-dir", batches, port=args.port) as srv:
        srv.wait_ready(headers={})
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        ops = [r.ok() for r in schema.get_all_operations()]
        tally, t0 = Tally(), time.time()
        deadline = t0 + args.max_time
        for k, op in enumerate(ops):  # each operation its share of the time left
            share = (deadline - time.time()) / (len(ops) - k)
            run_operation(op, srv.url, tally, args.examples, time.time() + share, args.max_tokens)
        elapsed = time.time() - t0
        alive = srv.proc.poll() is None
    print(
        f"# schemathesis {schemathesis.__version__} against llmserve serve ({cpu_name()}), {time.strftime('%Y-%m-%d')}"
    )
    print(f"operations: {len(ops)}; requests: {tally.requests} in {elapsed:.0f} s; server alive at the end: {alive}")
    print("answers: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.answers.items())))
    print(f"examples per operation and mode: {args.examples}; token budget: {args.max_tokens}")
    print("200 content types: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.media.items())))
    for name in [c.__name__ for c in CHECKS] + ["response_schema_conformance", "client"]:
        found = tally.failures.get(name, [])
        print(f"{name}: {len(found)} failures" + (f"; e.g. {found[0]}" if found else ""))
    return 0 if alive and not tally.failures else 1


if __name__ == "__main__":
    sys.exit(main())
