"""The router benchmark's load and processes (benchmarks.serving.router): streamed requests over HTTP in an open
or a closed loop, their records and percentiles, and the `Fleet` of replicas, routers and fake backends it starts."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass

import httpx

from llmserve.bench.scrape import parse_prometheus
from llmserve.bench.sse import aiter_sse
from llmserve.testing.launcher import FAKE, ROUTE, ServerProcess, free_port

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river mountain garden window light music paper market table"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ----------------------------------------------------------------------------------------------
# load generation
# ----------------------------------------------------------------------------------------------


@dataclass
class Req:
    kind: str  # short | long | tenant
    payload: dict
    at: float = 0.0  # open loop: seconds after start


@dataclass
class Rec:
    kind: str
    ok: bool
    ttft: float | None = None
    e2e: float | None = None
    backend: str | None = None
    error: str | None = None


async def send(client: httpx.AsyncClient, url: str, req: Req) -> Rec:
    path = "/v1/chat/completions" if "messages" in req.payload else "/v1/completions"
    t0 = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", url + path, json={**req.payload, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return Rec(req.kind, False, error=f"{r.status_code} {r.text[:200]}")
            async for ev in aiter_sse(r.aiter_bytes()):
                if ev.done:
                    continue
                d = ev.json()
                if "error" in d:
                    return Rec(req.kind, False, error=str(d["error"]))
                c = (d.get("choices") or [{}])[0]
                text = (c.get("delta") or {}).get("content") or c.get("text")
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
            return Rec(req.kind, True, ttft, time.perf_counter() - t0, r.headers.get("x-llmserve-backend"))
    except httpx.HTTPError as e:
        return Rec(req.kind, False, error=repr(e))


async def open_loop(url: str, reqs: list[Req]) -> list[Rec]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        start = time.perf_counter()

        async def one(r: Req) -> Rec:
            await asyncio.sleep(max(0.0, start + r.at - time.perf_counter()))
            return await send(c, url, r)

        return list(await asyncio.gather(*(one(r) for r in reqs)))


async def closed_loop(url: str, reqs: list[Req], concurrency: int) -> list[Rec]:
    queue = list(reversed(reqs))
    out: list[Rec] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:

        async def worker():
            while queue:
                out.append(await send(c, url, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def backend_metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)


# ----------------------------------------------------------------------------------------------
# processes
# ----------------------------------------------------------------------------------------------


class Fleet:
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.procs: list[ServerProcess] = []

    def start(self, *flags: str, cmd: tuple[str, ...], log: str, timeout: float) -> str:
        p = ServerProcess(*flags, cmd=cmd, log_path=os.path.join(self.log_dir, log))
        self.procs.append(p)
        return p.wait_ready(timeout).url

    def replicas(self, n: int, flags: list[str]) -> list[str]:
        ports = [free_port() for _ in range(n)]
        ps = [
            ServerProcess(
                "--num-threads",
                "1",
                "--log-level",
                "warning",
                *flags,
                port=port,
                log_path=os.path.join(self.log_dir, f"serve-{port}.log"),
            )
            for port in ports
        ]
        self.procs += ps
        return [p.wait_ready(300).url for p in ps]

    def router(self, backends: list[str], policy: str, *extra: str) -> str:
        return self.start(
            "--policy",
            policy,
            "--log-level",
            "warning",
            "--health-interval",
            "2",
            *extra,
            *[x for b in backends for x in ("--backend", b)],
            cmd=ROUTE,
            log=f"route-{policy}.log",
            timeout=60,
        )

    def fake(self, *flags: str) -> str:
        return self.start("--model", "fake", *flags, cmd=FAKE, log="fake.log", timeout=60)

    def stop(self, urls: list[str] | None = None) -> None:
        for p in list(self.procs):
            if urls is None or p.url in urls:
                p.stop()
                self.procs.remove(p)
