"""`llmserve bench` against a real `llmserve serve` (the bundled model on CPU).

A sweep of concurrency 1 and 5, 10 requests each, 16 tokens at most: the JSON and the PNG plots
exist and parse, and the token counts in the JSON are the server's own (its usage chunks, and the
increase of its /metrics token counters over the run).
"""

from __future__ import annotations

import json

import httpx
import pytest

from llmserve.bench.scrape import parse_prometheus, pick
from llmserve.cli import main
from llmserve.testing.launcher import ServerProcess

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with ServerProcess(log_path=str(log)) as srv:
        yield srv.wait_ready(180).url


def counters(url: str) -> dict:
    got = pick(parse_prometheus(httpx.get(url + "/metrics", timeout=10).text))
    return {k: got.get(k, 0.0) for k in ("prompt_tokens", "generation_tokens")}  # absent = 0


def test_sweep_1_5_writes_json_and_plots_with_the_servers_token_counts(server, tmp_path):
    before = counters(server)
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--base-url",
            server,
            "--concurrency",
            "1,5",
            "--num-requests",
            "10",
            "--output-len",
            "16",
            "--output-dir",
            str(out),
            "--no-progress",
            "--scrape-interval",
            "0.5",
        ]
    )
    assert rc == 0
    after = counters(server)

    result = json.loads((out / "bench.json").read_text())
    assert result["config"]["tokenizer"] == "server /tokenize"
    phases = result["phases"]
    assert [p["summary"]["level"] for p in phases] == [1, 5]
    records = [r for p in phases for r in p["requests"]]
    for p in phases:
        s = p["summary"]
        assert s["requests"] == 10 and s["completed"] == 10, s["errors"]
        assert s["output_tokens_source"] == {"usage": 10}
        assert s["ttft_ms"]["mean"] > 0 and s["e2el_ms"]["mean"] >= s["ttft_ms"]["mean"]
        assert s["server"]["flavor"] == "llmserve"
    assert phases[0]["summary"]["peak_concurrency"] == 1
    assert all(1 <= r["output_tokens"] <= 16 and r["prompt_tokens"] > 0 for r in records)
    # the JSON's counts are the server's: its usage chunks, and its own counters over the run
    out_tokens = sum(r["output_tokens"] for r in records)
    assert out_tokens == sum(p["summary"]["total_output_tokens"] for p in phases)
    assert after["generation_tokens"] - before["generation_tokens"] == out_tokens
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert sum(p["summary"]["server"]["generation_tokens"] for p in phases) == out_tokens

    import matplotlib.image as mpimg

    for png in ("throughput.png", "latency_percentiles.png", "latency_cdf.png"):
        assert mpimg.imread(out / png).ndim == 3
    assert "## Comparison across phases" in (out / "report.md").read_text()


@pytest.mark.parametrize("endpoint", ["responses", "messages", "embeddings"])
def test_the_responses_messages_and_embeddings_apis(server, tmp_path, endpoint):
    """--endpoint responses / messages: the typed event streams are timed, and their usage is the server's;
    embeddings: one answer each, no output tokens."""
    before = counters(server)
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--base-url",
                server,
                "--endpoint",
                endpoint,
                "--concurrency",
                "2",
                "--num-requests",
                "4",
                "--output-len",
                "8",
                "--output-json",
                str(out),
                "--no-progress",
                "--metrics-url",
                "none",
            ]
        )
        == 0
    )
    after = counters(server)
    phase = json.loads(out.read_text())["phases"][0]
    s = phase["summary"]
    assert s["completed"] == 4, s["errors"]
    assert s["output_tokens_source"] == {"usage": 4} and s["ttft_ms"]["mean"] > 0
    assert (s["itl_ms"]["mean"] is None) == (endpoint == "embeddings")
    assert (s["total_output_tokens"] == 0) == (endpoint == "embeddings")
    assert after["generation_tokens"] - before["generation_tokens"] == s["total_output_tokens"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == s["total_input_tokens"]
