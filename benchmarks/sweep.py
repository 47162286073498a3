"""The seed articles' sweep against llmserve: one request at a time x10, then 5 and 20 at once.

  python benchmarks/sweep.py                         # starts `llmserve serve` on a free port
  python benchmarks/sweep.py --serve-args "--max-num-seqs 8"
  python benchmarks/sweep.py --base-url http://127.0.0.1:8000   # a server already running

Writes OUTPUT_DIR/{bench.json, report.md, *.png, server.log} and prints a Markdown section for
BENCHMARKS.md (the articles' table: concurrency, total time, mean per request, req/s, and more).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmserve.bench import report  # noqa: E402
from llmserve.cli import main as llmserve_main  # noqa: E402
from llmserve.testing.launcher import ServerProcess  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="bench this server instead of starting one")
    p.add_argument("--serve-args", default="", help="extra `llmserve serve` flags")
    p.add_argument("--concurrency", default="1,5,20")
    p.add_argument("--num-requests", default="10,5,20")
    p.add_argument("--output-len", default=None, help="default: the sample answers' lengths")
    p.add_argument("--output-dir", default="bench-out/sweep")
    p.add_argument("bench_args", nargs="*", help="more `llmserve bench` flags, after --")
    a = p.parse_args()
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    srv, url = None, a.base_url
    try:
        if url is None:
            srv = ServerProcess(*shlex.split(a.serve_args), log_path=str(out / "server.log"))
            url = srv.wait_ready(300).url
        args = [
            "bench",
            "--base-url",
            url,
            "--concurrency",
            a.concurrency,
            "--num-requests",
            a.num_requests,
            "--output-dir",
            str(out),
            *a.bench_args,
        ]
        if a.output_len:
            args += ["--output-len", a.output_len]
        rc = llmserve_main(args)
    finally:
        if srv is not None:
            srv.stop()
    if rc:
        return rc
    result = json.loads((out / "bench.json").read_text())
    summaries = [ph["summary"] for ph in result["phases"]]
    cfg = result["config"]
    print("\n" + "-" * 72 + "\nMarkdown for BENCHMARKS.md:\n")
    print(
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"model `{cfg['model']}`; endpoint `{cfg['endpoint']}`; dataset `{cfg['dataset']}`"
        f"{' (' + a.serve_args + ')' if a.serve_args else ''}.\n"
    )
    print(report.markdown_table(*report.comparison_rows(summaries)))
    if result.get("advice"):
        print("\n" + "\n".join(f"- {t}" for t in result["advice"]))
    print(f"\n![throughput]({out}/throughput.png)\n![latency]({out}/latency_percentiles.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
