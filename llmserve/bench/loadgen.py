"""Load generation: the load modes, each sending `BenchRequest`s through the client (client.py).

Load modes (each `LoadPhase` is one of them):
  concurrency  closed loop: C workers, each sends its next request when the previous one finishes;
  rate         open loop: arrivals with gamma-distributed gaps (burstiness 1 = Poisson), or all at
               once when the rate is inf; optionally capped by max_concurrency;
  users        like locust: N users, each sends a request, waits a think time, and repeats;
  replay       a request log's arrivals (`BenchRequest.arrival`), sped up level times (llmserve tune).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .client import BenchRequest, OpenAIClient, RequestRecord


@dataclass
class LoadPhase:
    mode: str  # "concurrency" | "rate" | "users" | "replay"
    level: float  # concurrency, requests per second (inf = burst), users or replay speed-up
    num_requests: int | None = None  # stop after this many requests ...
    duration: float | None = None  # ... or after this many seconds (in-flight requests finish)
    burstiness: float = 1.0  # rate mode: gamma shape; 1 = Poisson, < 1 burstier, > 1 steadier
    max_concurrency: int | None = None  # rate mode: cap on requests in flight
    think_time: tuple[float, float] = (1.0, 3.0)  # users mode: seconds, uniform in [lo, hi]

    @property
    def name(self) -> str:
        level = "inf" if math.isinf(self.level) else f"{self.level:g}"
        return {
            "concurrency": f"concurrency={level}",
            "rate": f"rate={level}/s",
            "users": f"users={level}",
            "replay": f"replay x{level}",
        }[self.mode]


@dataclass
class PhaseRun:
    phase: LoadPhase
    records: list[RequestRecord]
    start: float
    end: float

    @property
    def wall_time(self) -> float:
        return self.end - self.start


class _Budget:
    """Hands out request indices until the count or the deadline is reached."""

    def __init__(self, num_requests: int | None, duration: float | None) -> None:
        self.left = num_requests if num_requests is not None else math.inf
        self.deadline = time.perf_counter() + duration if duration else math.inf
        self.next = 0

    def take(self) -> int | None:
        if self.left <= 0 or time.perf_counter() >= self.deadline:
            return None
        self.left -= 1
        self.next += 1
        return self.next - 1


async def run_phase(
    client: OpenAIClient,
    phase: LoadPhase,
    requests: Sequence[BenchRequest],
    seed: int = 0,
    on_chunk: Callable[[], None] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PhaseRun:
    """Run one phase; `requests` is used in order and cycled if the phase needs more."""
    if not requests:
        raise ValueError("no requests to send")
    records: list[RequestRecord] = []

    async def one(i: int) -> None:
        rec = await client.send(requests[i % len(requests)], i, on_chunk)
        records.append(rec)
        if on_done:
            on_done(rec)

    start = time.perf_counter()
    budget = _Budget(phase.num_requests, phase.duration)
    if phase.mode == "concurrency":

        async def worker() -> None:
            while (i := budget.take()) is not None:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(int(phase.level))))
    elif phase.mode == "users":
        rng = random.Random(seed)
        lo, hi = phase.think_time

        async def user() -> None:
            await asyncio.sleep(rng.uniform(0, hi))  # users arrive spread over one think time
            while (i := budget.take()) is not None:
                await one(i)
                await asyncio.sleep(rng.uniform(lo, hi))

        await asyncio.gather(*(user() for _ in range(int(phase.level))))
    elif phase.mode in ("rate", "replay"):
        gaps = _arrival_gaps(phase.level, phase.burstiness, seed) if phase.mode == "rate" else None
        cap = asyncio.Semaphore(phase.max_concurrency) if phase.max_concurrency else None

        async def capped(i: int) -> None:
            if cap is None:
                return await one(i)
            async with cap:
                await one(i)

        tasks, due = [], time.perf_counter()
        while (i := budget.take()) is not None:
            tasks.append(asyncio.create_task(capped(i)))
            if gaps is not None:
                due += next(gaps)  # absolute schedule: sleep overshoot does not accumulate
            else:  # the log's own gaps: the next request's offset within its cycle through the log
                nxt = budget.next
                cycle_len = (requests[-1].arrival or 0.0) + 1.0
                due = (
                    start
                    + ((nxt // len(requests)) * cycle_len + (requests[nxt % len(requests)].arrival or 0.0))
                    / phase.level
                )
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        await asyncio.gather(*tasks)
    else:
        raise ValueError(f"unknown load mode {phase.mode!r}")
    records.sort(key=lambda r: r.index)
    return PhaseRun(phase, records, start, time.perf_counter())


def _arrival_gaps(rate: float, burstiness: float, seed: int):
    """Seconds between arrivals: gamma(shape=burstiness, mean=1/rate), as `vllm bench serve`."""
    rng = random.Random(seed)
    while True:
        yield 0.0 if math.isinf(rate) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
