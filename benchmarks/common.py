"""Shared helpers for the benchmark scripts: the checkout's paths, prompts, machine description, llama.cpp's
server, BENCHMARKS.md sections. The scripts run as modules from the checkout's root
(`python -m benchmarks.kernels.gemv_paths`), so `llmserve`, `benchmarks` and `tests` import from the checkout."""

from __future__ import annotations

import datetime
import os
import platform
import re

# the random-weight checkpoints benchmarks/make_checkpoint.py writes (--out ~/ckpt/<name> by default)
CKPT = os.environ.get("LLMSERVE_CKPT_DIR", os.path.expanduser("~/ckpt"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
ALICE = os.path.join(ROOT, "tests", "data", "alice.txt")  # long prompts for TTFT runs

TOPICS = [
    "Docker",
    "the water cycle",
    "hash tables",
    "the French Revolution",
    "photosynthesis",
    "TCP handshakes",
    "black holes",
    "sourdough bread",
    "the stock market",
    "vaccines",
    "garbage collection",
    "the Roman Empire",
    "solar panels",
    "jazz music",
    "chess openings",
    "climate change",
]
TEMPLATES = [
    "What is {t}? Answer in one sentence.",
    "Explain {t} to a ten year old.",
    "Write a short essay about {t}. Cover its history, how it works, and why it matters today. "
    "Use clear language and give at least two concrete examples.",
    "Here are some notes I took: " + "I read about {t} today and it seemed complicated at first, "
    "but after a while the main ideas started to make sense. " * 6 + "Summarize what {t} is and "
    "list three questions I should ask to learn more.",
]


def chat_prompts(n: int = 64) -> list[list[dict]]:
    out = []
    for i in range(n):
        t = TOPICS[i % len(TOPICS)]
        tpl = TEMPLATES[(i // len(TOPICS)) % len(TEMPLATES)]
        out.append([{"role": "user", "content": tpl.format(t=t)}])
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = m.group(1) if m else cpu
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores"


def cpu_class() -> str:
    """The instruction set a CPU kernel picks by (AVX-512 with BF16 / VNNI, AVX-512, AVX2, other): a section of
    figures keyed by it keeps another machine's figures beside it rather than overwriting them."""
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^flags\s*:\s*(.*)$", f.read(), re.M)
            flags = set(m.group(1).split()) if m else set()
    except OSError:
        flags = set()
    if "avx512f" in flags:
        extra = [n for f, n in (("amx_tile", "AMX"), ("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI")) if f in flags]
        return "AVX-512" + (" " + "/".join(extra) if extra else "")
    return "AVX2" if "avx2" in flags else platform.machine()


def start_llama_server(
    binary: str,
    threads: int,
    slots: int,
    context: int,
    model: str | None = None,
    extra: tuple[str, ...] = (),
    timeout: float = 600.0,
):
    """llama.cpp's llama-server on the bundled GGUF (or `model`), continuous batching over `slots`
    parallel slots, `extra` flags after the rest (`--mmproj FILE`); returns (process, base URL) once /health
    answers 200. Raises, with the end of the server's log, if it exits or is not ready within `timeout` s."""
    import subprocess
    import tempfile
    import time

    import httpx

    from llmserve.model.loader import bundled_model_path
    from llmserve.testing.launcher import free_port

    port = free_port()
    log = tempfile.NamedTemporaryFile("w+b", prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [binary, "-m", model or bundled_model_path(), "--port", str(port), "-np", str(slots), "-cb"]
        + ["-t", str(threads), "-c", str(context), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    log.seek(0)
    tail = log.read().decode(errors="replace")[-2000:]
    raise RuntimeError(f"llama-server did not become ready (exit {proc.returncode}; log {log.name}):\n{tail}")


def write_section(title: str, body: str, path: str | None = None) -> None:
    """Replace (or append) the `## title` section of BENCHMARKS.md: up to the next `## ` section or `# ` topic."""
    path = path or os.path.join(ROOT, "BENCHMARKS.md")
    text = (
        open(path).read()
        if os.path.exists(path)
        else "# Benchmarks\n\nMeasured, not asserted: each section says how it was run.\n"
    )
    stamp = datetime.date.today().isoformat()
    section = f"## {title}\n\n_{stamp}, {machine()}_\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^#{{1,2}} |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    with open(path, "w") as f:
        f.write(text)


def llmserve_bench(url: str, c: int, num_requests: int, input_len: int, output_len: int, out: str, *extra) -> dict:
    """`llmserve bench` against a server at `url` (any OpenAI-compatible one): chat, random prompts, EOS ignored,
    greedy, one warm-up; its summary's output tok/s, median TTFT, p99 ITL and failed requests."""
    import json
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", url, "--concurrency", str(c)]
        + ["--num-requests", str(num_requests), "--dataset", "random", "--input-len", str(input_len)]
        + ["--output-len", str(output_len), "--ignore-eos", "--temperature", "0", "--no-progress"]
        + ["--output-json", out, *extra],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    s = json.load(open(out))["phases"][0]["summary"]
    return {
        "tok_s": s["output_throughput"],
        "ttft_median": s["ttft_ms"]["median"],
        "itl_p99": s["itl_ms"]["p99"],
        "failed": s.get("failed", 0),
    }


def peak_rss_gib(pid: int) -> float:
    """The peak resident memory (the kernel's VmHWM) of process `pid` and its children, GiB: read before it stops."""
    import psutil

    total = 0
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) << 10
        except (OSError, StopIteration):
            pass
    return total / 2**30


def ab_table(runs: dict, settings: list, concurrency: list, label: str) -> str:
    """A Markdown table of `runs` ({(setting, concurrency): [llmserve_bench results, one per round]}) and the ratios
    of each setting's medians to the first setting's."""
    import statistics

    lines = [
        f"| {label} | concurrency | output tok/s (each run) | median TTFT ms | p99 ITL ms | failed |",
        "|---|---|---|---|---|---|",
    ]
    fields = ("tok_s", "ttft_median", "itl_p99")
    nan = float("nan")  # a run whose requests all failed has no latency figures: shown as nan, never a crash

    def figure(r: dict, f: str) -> float:
        return nan if r.get(f) is None else r[f]

    med = {k: {f: statistics.median(figure(r, f) for r in v) for f in fields} for k, v in runs.items()}
    for (setting, c), v in runs.items():
        tok, ttft, itl = (" / ".join(f"{figure(r, f):.{d}f}" for r in v) for f, d in zip(fields, (2, 0, 0)))
        lines.append(f"| `{setting}` | {c} | {tok} | {ttft} | {itl} | {sum(r['failed'] for r in v)} |")
    lines.append("")
    base = settings[0]
    for setting in settings[1:]:
        for c in concurrency:
            m, b = med[(setting, c)], {f: x or nan for f, x in med[(base, c)].items()}
            lines.append(
                f"- `{setting}` against `{base}` at {c} concurrent (medians): "
                f"throughput {m['tok_s'] / b['tok_s']:.2f}x, median TTFT {m['ttft_median'] / b['ttft_median']:.2f}x, "
                f"p99 ITL {m['itl_p99'] / b['itl_p99']:.2f}x"
            )
    return "\n".join(lines)
