"""The circuit breaker (llmserve/breaker.py) on a clock the test moves: it opens after its threshold of
failures in a row, lets no request call while open, half-opens for one trial when due, and logs one line per
change between usable and not usable."""

from __future__ import annotations

import logging

from llmserve.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(caplog, **kw):
    clock = Clock()
    caplog.set_level(logging.DEBUG, logger="test.breaker")
    return CircuitBreaker("store", logging.getLogger("test.breaker"), clock=clock, **kw), clock


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_opens_after_the_threshold_of_failures_in_a_row(caplog):
    b, _ = make(caplog, failure_threshold=3)
    b.failure("timeout")
    b.failure("timeout")
    b.success()  # a success in between: the count starts over
    b.failure("timeout")
    b.failure("timeout")
    assert b.state == CLOSED and b.allow()
    b.failure("timeout")
    assert b.state == OPEN and not b.allow() and b.value == 1
    b.failure("timeout")  # more failures while open: no more lines
    assert len(warnings(caplog)) == 1 and "breaker open" in warnings(caplog)[0]


def test_half_opens_when_due_and_backs_off_while_the_trial_fails(caplog):
    b, clock = make(caplog, reset_after=5, max_reset_after=12)
    b.trip(ConnectionRefusedError("refused"))
    assert b.state == OPEN
    assert not b.probe_due()
    clock.now += 5
    assert b.probe_due() and b.state == HALF_OPEN and b.value == 2
    assert not b.allow()  # requests still do not call: the trial is the prober's
    b.failure("refused")
    assert b.state == OPEN and b.reset_after == 10
    clock.now += 9
    assert not b.probe_due()
    clock.now += 1
    assert b.probe_due()
    b.failure("refused")
    assert b.reset_after == 12  # capped
    clock.now += 12
    assert b.probe_due()
    b.success()
    assert b.state == CLOSED and b.allow() and b.reset_after == 5
    lines = warnings(caplog)
    assert len(lines) == 2, lines  # open once, closed once: trial failures are not state changes
    assert "ConnectionRefusedError: refused" in lines[0] and "reachable again" in lines[1]
