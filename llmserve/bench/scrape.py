"""Scrape the server's Prometheus `/metrics` while a phase runs, for the server-side view:
requests running and waiting, KV-cache usage, prefix-cache hit rate, preemptions, token counters.

Names are looked up in this order: llmserve's, vLLM's, SGLang's, llama.cpp's; samples with the same
name and different labels (e.g. one per model) are summed.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import NamedTuple

import httpx

ALIASES = {
    "running": [
        "llmserve:num_requests_running",
        "vllm:num_requests_running",
        "sglang:num_running_reqs",
        "llamacpp:requests_processing",
    ],
    "waiting": [
        "llmserve:num_requests_waiting",
        "vllm:num_requests_waiting",
        "sglang:num_queue_reqs",
        "llamacpp:requests_deferred",
    ],
    "kv_usage": [
        "llmserve:kv_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    ],
    "prefix_queries": [
        "llmserve:prefix_cache_queries_total",
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
    ],
    "prefix_hits": [
        "llmserve:prefix_cache_hits_total",
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
    ],
    "preemptions": ["llmserve:num_preemptions_total", "vllm:num_preemptions_total"],
    "prompt_tokens": ["llmserve:prompt_tokens_total", "vllm:prompt_tokens_total", "sglang:prompt_tokens_total"],
    "generation_tokens": [
        "llmserve:generation_tokens_total",
        "vllm:generation_tokens_total",
        "sglang:generation_tokens_total",
    ],
}
GAUGES = ("running", "waiting", "kv_usage")
COUNTERS = ("prefix_queries", "prefix_hits", "preemptions", "prompt_tokens", "generation_tokens")

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float
    key: str  # the name and labels as written: 'name{a="1",b="2"}' (the bare name if no labels)


def parse_samples(text: str) -> list[Sample]:
    """Prometheus text format -> its samples, in order (comments and unparsable lines skipped)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:  # comments (# HELP / # TYPE) and blank lines
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        raw = m.group(2) or ""
        labels = {
            k: _ESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), v) for k, v in _LABEL.findall(raw)
        }
        out.append(Sample(m.group(1), labels, value, m.group(1) + raw))
    return out


def parse_prometheus(text: str, labelled: bool = False) -> dict[str, float]:
    """Prometheus text format -> {sample name: value summed over label sets}; with `labelled`,
    also every labelled sample under its key as written ('name{a="1"}': value)."""
    out: dict[str, float] = {}
    for s in parse_samples(text):
        out[s.name] = out.get(s.name, 0.0) + s.value
        if labelled and s.labels:
            out[s.key] = s.value
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    return sum(
        s.value
        for s in parse_samples(text)
        if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items())
    )


def pick(samples: dict[str, float]) -> dict[str, float]:
    """Our names -> values, from whichever server's names are present."""
    got = {}
    for key, names in ALIASES.items():
        for name in names:
            if name in samples:
                got[key] = samples[name]
                break
    return got


class MetricsScraper:
    """Polls `/metrics` every `interval` seconds between `start()` and `stop()`."""

    def __init__(self, http: httpx.AsyncClient, url: str = "/metrics", interval: float = 1.0):
        self.http, self.url, self.interval = http, url, interval
        self.flavor: str | None = None
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    async def scrape(self) -> dict[str, float] | None:
        try:
            r = await self.http.get(self.url, timeout=5.0)
            if r.status_code != 200:
                return None
            raw = parse_prometheus(r.text)
        except (httpx.HTTPError, UnicodeDecodeError):
            return None
        got = pick(raw)
        if got and self.flavor is None:
            self.flavor = next(
                n.split(":")[0] for n in raw if ":" in n and any(n in names for names in ALIASES.values())
            )
        return got or None

    async def probe(self) -> bool:
        return await self.scrape() is not None

    async def start(self) -> None:
        self.samples, self._t0 = [], time.perf_counter()
        await self._sample()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._sample()
        return self.summary()

    async def _sample(self) -> None:
        got = await self.scrape()
        if got is not None:
            self.samples.append((time.perf_counter() - self._t0, got))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._sample()

    def summary(self) -> dict:
        """Gauges: mean and max over the samples; counters: increase over the phase."""
        if not self.samples:
            return {}
        out: dict = {"source": self.url, "flavor": self.flavor, "samples": len(self.samples)}
        for key in GAUGES:
            vals = [s[key] for _, s in self.samples if key in s]
            if vals:
                out[key] = {"mean": sum(vals) / len(vals), "max": max(vals)}
        first, last = self.samples[0][1], self.samples[-1][1]
        for key in COUNTERS:  # a labelled counter appears at its first increment: absent = 0
            if key in last:
                out[key] = last[key] - first.get(key, 0.0)
        if out.get("prefix_queries"):
            out["prefix_cache_hit_rate"] = out.get("prefix_hits", 0.0) / out["prefix_queries"]
        out["timeline"] = [
            [round(t, 3), s.get("running"), s.get("waiting"), s.get("kv_usage")] for t, s in self.samples
        ]
        return out
