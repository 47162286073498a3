"""`llmserve bench` against a fake OpenAI-compatible server with known timings.

The fake server runs in its own process on 127.0.0.1 (so it shares no GIL with the client) and
answers every request with a first token after TTFT = 200 ms and one token every 20 ms: the
measured TTFT, TPOT, ITL, E2E and throughput must match that truth within 10%.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from llmserve.bench.client import BenchRequest, OpenAIClient, auto_timeout
from llmserve.cli import main
from llmserve.testing.fake_openai import control
from llmserve.testing.launcher import FAKE, ServerProcess

pytestmark = pytest.mark.timeout(120)

TTFT, ITL, TOKENS = 0.200, 0.020, 20
E2E = TTFT + (TOKENS - 1) * ITL


@pytest.fixture(scope="module")
def fake():
    with ServerProcess(cmd=FAKE) as server:
        yield server.wait_ready(30)


def configure(fake, **fields) -> None:
    """The fake's whole config (unset fields take their defaults); request numbering restarts."""
    control(fake.url, reset=True, **fields)


def bench(fake, tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--base-url", fake.url + "/v1", "--no-progress", "--output-json", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


def close(measured: float, truth: float, tol: float = 0.10) -> bool:
    return abs(measured - truth) <= tol * truth


def test_timings_and_throughput_match_the_truth(fake, tmp_path):
    configure(fake, ttft=TTFT, itl=ITL, tokens=TOKENS)
    out_dir = tmp_path / "out"
    result = bench(fake, tmp_path, "--concurrency", "1,4", "--num-requests", "4,8", "--output-dir", str(out_dir))
    assert [p["summary"]["phase"] for p in result["phases"]] == ["concurrency=1", "concurrency=4"]
    for phase, waves in zip(result["phases"], (4, 2)):
        s = phase["summary"]
        assert s["completed"] == s["requests"] and s["failed"] == 0
        # TTFT skips the role-only first chunk: it is the first non-empty content
        assert close(s["ttft_ms"]["mean"] / 1000, TTFT) and close(s["ttft_ms"]["median"] / 1000, TTFT)
        assert close(s["tpot_ms"]["mean"] / 1000, ITL) and close(s["tpot_ms"]["median"] / 1000, ITL)
        assert close(s["itl_ms"]["mean"] / 1000, ITL) and close(s["itl_ms"]["median"] / 1000, ITL)
        assert close(s["e2el_ms"]["mean"] / 1000, E2E)
        assert s["total_output_tokens"] == TOKENS * s["requests"]
        assert s["output_tokens_source"] == {"usage": s["requests"]}
        wall_truth = waves * E2E  # closed loop: the phase is `waves` back-to-back answers
        assert close(s["output_throughput"], TOKENS * s["requests"] / wall_truth)
        assert close(s["request_throughput"], s["requests"] / wall_truth)
        assert s["peak_concurrency"] == int(s["level"])
        srv = s["server"]  # the fake's /metrics, scraped during the phase
        assert srv["flavor"] == "llmserve"
        assert srv["generation_tokens"] == TOKENS * s["requests"]
        assert srv["running"]["max"] <= s["level"]
        recs = phase["requests"]
        assert len(recs) == s["requests"] and all(len(r["itl_s"]) == TOKENS - 1 for r in recs)
    assert (out_dir / "report.md").read_text().count("![") == 3
    assert json.loads((out_dir / "bench.json").read_text())["config"]["model"] == "fake-model"
    for png in ("throughput.png", "latency_percentiles.png", "latency_cdf.png"):
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_injected_errors_are_counted_not_crashed_on(fake, tmp_path):
    configure(
        fake,
        ttft=0.01,
        itl=0.005,
        tokens=8,
        errors={1: "http_500", 2: "http_429", 3: "cut", 4: "abort", 5: "error_event"},
    )
    result = bench(fake, tmp_path, "--concurrency", "2", "--num-requests", "10")
    s = result["phases"][0]["summary"]
    assert s["errors"] == {"http_500": 1, "http_429": 1, "incomplete_stream": 2, "server_error": 1}
    assert s["completed"] == 5 and s["failed"] == 5
    assert s["total_output_tokens"] == 5 * 8
    assert any("refused (429/503)" in t for t in result["advice"])


def test_a_hung_request_times_out(fake, tmp_path):
    configure(fake, ttft=0.01, itl=0.005, tokens=4, errors={0: "hang"})
    result = bench(fake, tmp_path, "--concurrency", "2", "--num-requests", "3", "--timeout", "1")
    s = result["phases"][0]["summary"]
    assert s["errors"] == {"timeout": 1} and s["completed"] == 2
    assert 0.9 <= s["duration_s"] < 5
    assert auto_timeout(BenchRequest("p", 1000, 1000)) > 5 * auto_timeout(BenchRequest("p", 1, 1))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_no_usage_chunk_split_lines_pings_and_utf8(fake, endpoint):
    """N re-counted by the server's /tokenize; events cut mid-line; pings; multi-byte text."""
    configure(fake, ttft=0.01, itl=0.005, tokens=12, send_usage=False, split_lines=True, ping_every=3, word="tök")

    async def go():
        client = OpenAIClient(fake.url, endpoint=endpoint)
        try:
            await client.resolve_model()
            return await client.send(BenchRequest("Hello there", 2, 12))
        finally:
            await client.aclose()

    rec = asyncio.run(go())
    assert rec.success and rec.error is None
    assert rec.text == " ".join(f"tök{i}" for i in range(12))
    assert rec.output_tokens is None and rec.chunks == 12 and len(rec.itl) == 11


def test_without_usage_the_bench_retokenises(fake, tmp_path):
    configure(fake, ttft=0.01, itl=0.005, tokens=9, send_usage=False)
    result = bench(
        fake,
        tmp_path,
        "--endpoint",
        "completions",
        "--num-requests",
        "3",
        "--dataset",
        "random",
        "--input-len",
        "10-20",
        "--output-len",
        "9",
    )
    s = result["phases"][0]["summary"]
    assert s["output_tokens_source"] == {"tokenizer": 3} and s["total_output_tokens"] == 27
    assert all(10 <= r["prompt_len"] <= 20 for r in result["phases"][0]["requests"])


def test_rate_burst_and_users_modes(fake, tmp_path):
    configure(fake, ttft=0.05, itl=0.01, tokens=5)
    result = bench(fake, tmp_path, "--request-rate", "inf,20", "--num-requests", "6,10")
    burst, paced = (p["summary"] for p in result["phases"])
    assert burst["peak_concurrency"] == 6 and burst["completed"] == 6
    starts = sorted(r["start_s"] for r in result["phases"][1]["requests"])
    assert paced["completed"] == 10 and 0.1 < starts[-1] < 2.0  # ~9 gaps of 50 ms on average
    result = bench(fake, tmp_path, "--users", "2", "--think-time", "0.05-0.1", "--num-requests", "6", "--warmup", "2")
    s = result["phases"][0]["summary"]
    assert s["completed"] == 6 and s["peak_concurrency"] <= 2
    result = bench(fake, tmp_path, "--concurrency", "2", "--duration", "0.5")
    s = result["phases"][0]["summary"]
    assert s["completed"] >= 4 and 0.5 <= s["duration_s"] < 1.5  # ~100 ms answers, 2 at a time


def test_server_without_metrics_and_unreachable_server(fake, tmp_path, capsys):
    configure(fake, ttft=0.01, itl=0.005, tokens=4, metrics=False)
    result = bench(fake, tmp_path, "--num-requests", "2")
    assert result["phases"][0]["summary"]["server"] == {}
    rc = main(["bench", "--base-url", "http://127.0.0.1:9", "--no-progress"])
    assert rc == 2 and "is the server up" in capsys.readouterr().err
