"""The bench's figures from hand-made records: formulas, goodput, knee, SLO, advice, outputs."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random

import pytest

from llmserve.bench import advice, cli, report
from llmserve.bench.client import RequestRecord
from llmserve.bench.datasets import (
    DatasetConfig,
    WordTokenizer,
    build_requests,
    exact_length_text,
    load_sharegpt,
    parse_range,
    sample_path,
)
from llmserve.bench.loadgen import LoadPhase, PhaseRun, _arrival_gaps
from llmserve.bench.metrics import (
    best_under_slo,
    distribution,
    find_knee,
    meets_slo,
    parse_slo,
    peak_concurrency,
    request_tpot,
    summarize,
)
from llmserve.bench.scrape import parse_prometheus, pick


def rec(i, start, ttft, e2e, n, ok=True, error=None, gaps=None) -> RequestRecord:
    r = RequestRecord(
        index=i,
        prompt_len=10,
        max_tokens=n,
        start=start,
        end=start + e2e,
        ttft=ttft if ok else None,
        output_tokens=n if ok else None,
        output_tokens_source="usage" if ok else "",
        success=ok,
        error=error,
    )
    r.itl = gaps if gaps is not None else ([(e2e - ttft) / (n - 1)] * (n - 1) if ok and n > 1 else [])
    return r


def phase_run(level, records, wall, mode="concurrency") -> PhaseRun:
    return PhaseRun(LoadPhase(mode, level, len(records)), records, 100.0, 100.0 + wall)


def test_distribution_matches_numpy_percentiles():
    d = distribution([0.1, 0.2, 0.3, 0.4])
    assert d["mean"] == pytest.approx(250.0)
    assert d["median"] == pytest.approx(250.0)
    assert d["p90"] == pytest.approx(370.0)  # linear interpolation
    assert distribution([])["mean"] is None


def test_tpot_and_summary_formulas():
    recs = [
        rec(0, 100.0, 0.2, 0.2 + 9 * 0.05, 10),
        rec(1, 100.0, 0.3, 0.3 + 4 * 0.1, 5),
        rec(2, 100.5, 0.1, 0.1, 1),  # one token: no TPOT
        rec(3, 100.2, 0, 0.5, 0, ok=False, error="timeout"),
    ]
    assert request_tpot(recs[0]) == pytest.approx(0.05)
    assert request_tpot(recs[2]) is None
    s = summarize(phase_run(4, recs, 2.0))
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == {"timeout": 1}
    assert s["total_output_tokens"] == 16
    assert s["output_throughput"] == pytest.approx(8.0)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["total_token_throughput"] == pytest.approx((30 + 16) / 2.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(75.0)  # mean of 50 and 100; N=1 excluded
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["mean"] == pytest.approx((9 * 50 + 4 * 100) / 13)
    assert s["peak_concurrency"] == 4  # all four overlap at t=100.5


def test_goodput_counts_requests_meeting_every_slo():
    recs = [
        rec(0, 0, 0.2, 0.2 + 9 * 0.02, 10),
        rec(1, 0, 0.6, 0.6 + 9 * 0.02, 10),
        rec(2, 0, 0.2, 0.2 + 9 * 0.08, 10),
        rec(3, 0, 0, 1, 0, ok=False, error="http_500"),
    ]
    slo = parse_slo(["ttft:500", "tpot:50"])
    assert slo == {"ttft": 500.0, "tpot": 50.0}
    assert [meets_slo(r, slo) for r in recs] == [True, False, False, False]
    s = summarize(phase_run(4, recs, 2.0), slo)
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert parse_slo("ttft:1,e2e:3") == {"ttft": 1.0, "e2el": 3.0}
    with pytest.raises(ValueError):
        parse_slo(["latency:3"])


def test_peak_concurrency_counts_overlap_not_touching():
    a = RequestRecord(0, 1, 1, start=0.0, end=1.0)
    b = RequestRecord(1, 1, 1, start=1.0, end=2.0)  # starts as a ends
    c = RequestRecord(2, 1, 1, start=0.5, end=1.5)
    assert peak_concurrency([a, b]) == 1
    assert peak_concurrency([a, b, c]) == 2


def sweep(points):
    """(level, out tok/s, mean e2e s) -> summaries."""
    out = []
    for level, thr, lat in points:
        n = 10
        recs = [rec(i, 0, lat / 4, lat, 20) for i in range(n)]
        s = summarize(phase_run(level, recs, n * 20 / thr))
        out.append(s)
    return out


def test_knee_where_throughput_flattens_and_latency_grows():
    s = sweep([(1, 30, 0.6), (5, 120, 0.8), (20, 140, 2.8)])
    knee = find_knee(s)
    assert knee["level"] == 5 and knee["saturated"]
    assert knee["beyond"]["throughput_gain"] == pytest.approx(140 / 120, rel=1e-6)
    tips = advice.recommend(s, knee)
    assert "Knee at concurrency 5" in tips[0]


def test_no_knee_while_throughput_scales():
    s = sweep([(1, 30, 0.6), (5, 140, 0.65), (20, 520, 0.7)])
    knee = find_knee(s)
    assert knee["level"] == 20 and not knee["saturated"]
    assert "No knee" in advice.recommend(s, knee)[0]
    assert find_knee(s[:1]) is None


def test_best_under_slo_is_the_highest_level_meeting_it():
    slo = {"e2el": 1000.0}
    summaries = []
    for level, lat in ((1, 0.5), (5, 0.9), (20, 2.0)):
        recs = [rec(i, 0, 0.1, lat, 10) for i in range(10)]
        summaries.append(summarize(phase_run(level, recs, 1.0), slo))
    best = best_under_slo(summaries, 90)
    assert best["level"] == 5
    tips = advice.recommend(summaries, find_knee(summaries), best, slo, 90)
    assert any("holds up to concurrency 5" in t for t in tips)
    assert best_under_slo(summaries[2:], 90) is None


def server(waiting_max, kv_max, running_max=8, preemptions=0, running_mean=None):
    return {
        "running": {"mean": running_max if running_mean is None else running_mean, "max": running_max},
        "waiting": {"mean": waiting_max / 2, "max": waiting_max},
        "kv_usage": {"mean": kv_max / 2, "max": kv_max},
        "preemptions": preemptions,
    }


@pytest.mark.parametrize(
    "srv, expect",
    [
        (server(6, 0.97), "--kv-cache-memory"),
        (server(6, 0.2), "--max-num-seqs"),  # running held at its peak: a cap
        (server(61, 0.1, running_max=48, running_mean=35.2), "prompts waited for their prefill"),
        (server(0, 0.3), "compute-bound"),
        (server(0, 0.95, preemptions=3), "preempted"),
    ],
)
def test_advice_reads_server_metrics(srv, expect):
    s = sweep([(1, 30, 0.6), (20, 35, 2.8)])
    s[-1]["server"] = srv
    assert any(expect in t for t in advice.recommend(s, find_knee(s)))


def test_advice_on_errors_and_ttft_growth():
    s = sweep([(1, 30, 0.6), (20, 35, 2.8)])
    s[-1]["errors"] = {"timeout": 2, "http_429": 1, "incomplete_stream": 1, "http_500": 1}
    s[-1]["ttft_ms"]["median"] = s[0]["ttft_ms"]["median"] * 10
    text = " ".join(advice.recommend(s))
    for needle in ("timed out", "refused (429/503)", "cut off", "http_500 x1", "queue before"):
        assert needle in text


def test_prometheus_parsing_sums_labels_and_maps_names():
    text = """# HELP x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3
vllm:num_requests_running{model_name="b",x="1 2"} 2.0
vllm:num_requests_waiting 1
vllm:gpu_cache_usage_perc 0.5
vllm:prefix_cache_queries_total 100
vllm:prefix_cache_hits_total 25
vllm:num_preemptions_total 0
vllm:generation_tokens_total 1e3
"""
    got = pick(parse_prometheus(text))
    assert got == {
        "running": 5.0,
        "waiting": 1.0,
        "kv_usage": 0.5,
        "prefix_queries": 100.0,
        "prefix_hits": 25.0,
        "preemptions": 0.0,
        "generation_tokens": 1000.0,
    }


def test_word_tokenizer_and_exact_length_text():
    tok = WordTokenizer()
    pool = tok.encode_sync("the quick brown fox, jumps over the lazy dog! " * 5)
    text, n = asyncio.run(exact_length_text(tok, [], pool, 3, 17))
    assert n == 17 and len(tok.encode_sync(text)) == 17
    lead = pool[:5]
    text, n = asyncio.run(exact_length_text(tok, lead, pool, 11, 12))
    assert n == 12 and tok.encode_sync(text)[:5] == lead


def test_datasets_with_the_word_tokenizer(tmp_path):
    tok = WordTokenizer()
    pairs = load_sharegpt(sample_path())
    assert len(pairs) >= 30
    reqs = asyncio.run(build_requests(DatasetConfig("sharegpt"), 50, tok))
    assert len(reqs) == 50 and all(r.output_len >= 4 and r.prompt_len >= 4 for r in reqs)

    reqs = asyncio.run(build_requests(DatasetConfig("random", input_len=(20, 40), output_len=(5, 9)), 20, tok))
    assert all(20 <= r.prompt_len <= 40 and 5 <= r.output_len <= 9 for r in reqs)
    assert all(len(tok.encode_sync(r.prompt)) == r.prompt_len for r in reqs)
    assert len({r.prompt for r in reqs}) == 20

    reqs = asyncio.run(build_requests(DatasetConfig("prefix", input_len=(8, 8), prefix_len=30), 6, tok))
    firsts = {tuple(tok.encode_sync(r.prompt)[:30]) for r in reqs}
    assert len(firsts) == 1 and all(r.prompt_len == 38 for r in reqs)

    txt = tmp_path / "p.txt"
    txt.write_text("first prompt here\n\nsecond one\n")
    reqs = asyncio.run(build_requests(DatasetConfig("prompts", str(txt), output_len=(7, 7)), 3, tok))
    assert [r.prompt for r in reqs] == ["first prompt here", "second one", "first prompt here"]
    assert [r.output_len for r in reqs] == [7, 7, 7]
    jl = tmp_path / "p.jsonl"
    jl.write_text(
        json.dumps({"prompt": "a b", "max_tokens": 3})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi there"}]})
        + "\n"
    )
    reqs = asyncio.run(build_requests(DatasetConfig("prompts", str(jl)), 2, tok))
    assert reqs[0].output_len == 3 and reqs[1].messages[0]["content"] == "hi there"
    assert parse_range("5") == (5, 5) and parse_range("5-9") == (5, 9)


def test_arrival_gaps_have_the_requested_mean():
    gaps = _arrival_gaps(4.0, 1.0, seed=1)
    xs = [next(gaps) for _ in range(4000)]
    assert sum(xs) / len(xs) == pytest.approx(0.25, rel=0.05)
    bursty = _arrival_gaps(4.0, 0.25, seed=1)
    ys = [next(bursty) for _ in range(4000)]
    var = lambda v: sum((x - sum(v) / len(v)) ** 2 for x in v) / len(v)  # noqa: E731
    assert var(ys) > 2 * var(xs)  # lower shape = burstier, same mean
    assert next(_arrival_gaps(math.inf, 1.0, 0)) == 0.0


def parse_args(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_phases_from_args():
    ph = cli.phases_from_args(parse_args(["--concurrency", "1,5,20", "--num-requests", "10,5,20"]))
    assert [(p.mode, p.level, p.num_requests) for p in ph] == [
        ("concurrency", 1, 10),
        ("concurrency", 5, 5),
        ("concurrency", 20, 20),
    ]
    ph = cli.phases_from_args(parse_args(["--request-rate", "2,inf", "--burstiness", "0.5"]))
    assert [p.name for p in ph] == ["rate=2/s", "rate=inf/s"] and ph[0].burstiness == 0.5
    assert [p.num_requests for p in ph] == [20, 50]
    ph = cli.phases_from_args(parse_args(["--users", "3", "--think-time", "0.5-1", "--duration", "9"]))
    assert ph[0].think_time == (0.5, 1.0) and ph[0].duration == 9 and ph[0].num_requests is None
    ph = cli.phases_from_args(parse_args(["--concurrency", "1,2", "--duration", "5"]))
    assert [(p.num_requests, p.duration) for p in ph] == [(None, 5), (None, 5)]
    with pytest.raises(cli.BenchError):
        cli.phases_from_args(parse_args(["--concurrency", "1,2", "--num-requests", "1,2,3"]))
    with pytest.raises(cli.BenchError):
        cli.phases_from_args(parse_args(["--concurrency", "1.5"]))


def test_reports_text_markdown_and_plots(tmp_path):
    rng = random.Random(0)
    runs, summaries = [], []
    for level in (1, 4):
        recs = [rec(i, 100 + i * 0.1, 0.2 + rng.random() / 10, 0.7 + rng.random() / 5, 20) for i in range(8)]
        r = phase_run(level, recs, 2.0)
        runs.append(r)
        summaries.append(summarize(r))
    summaries[1]["server"] = server(2, 0.4)
    text = report.phase_text(summaries[0]) + report.comparison_text(summaries)
    for needle in ("TTFT", "TPOT", "ITL", "E2E", "concurrency", "req/s", "srv KV max"):
        assert needle in text
    plots = report.write_plots(tmp_path, summaries, runs, find_knee(summaries))
    import matplotlib.image as mpimg

    for name in plots.values():
        assert mpimg.imread(tmp_path / name).shape[0] > 100
    result = {
        "config": {
            "base_url": "u",
            "model": "m",
            "endpoint": "chat",
            "dataset": "d",
            "tokenizer": "t",
            "started": "now",
        },
        "phases": [report.phase_json(r, s) for r, s in zip(runs, summaries)],
        "advice": ["do this"],
    }
    md = report.markdown_report(result, plots)
    assert "![throughput](throughput.png)" in md and "- do this" in md
    report.write_json(tmp_path / "x.json", result)
    back = json.loads((tmp_path / "x.json").read_text())
    assert back["phases"][0]["requests"][0]["output_tokens"] == 20


def test_scrape_summary_gauges_and_counter_increases():
    from llmserve.bench.scrape import MetricsScraper

    sc = MetricsScraper(http=None)
    sc.samples = [
        (0.0, {"running": 0.0, "waiting": 0.0, "kv_usage": 0.1}),  # counters not born
        (
            1.0,
            {
                "running": 4.0,
                "waiting": 2.0,
                "kv_usage": 0.5,
                "prefix_queries": 50.0,
                "prefix_hits": 10.0,
                "generation_tokens": 30.0,
            },
        ),
        (
            2.0,
            {
                "running": 2.0,
                "waiting": 0.0,
                "kv_usage": 0.3,
                "prefix_queries": 100.0,
                "prefix_hits": 40.0,
                "generation_tokens": 64.0,
            },
        ),
    ]
    s = sc.summary()
    assert s["running"] == {"mean": 2.0, "max": 4.0} and s["waiting"]["max"] == 2.0
    assert s["generation_tokens"] == 64.0 and s["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert "preemptions" not in s and len(s["timeline"]) == 3
