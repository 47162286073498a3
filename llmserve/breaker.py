"""A circuit breaker: stop calling a service that fails, try it again later.

`closed`: calls go through; `failure_threshold` failures in a row open it. `open`: callers are told not to
call (`allow()` is False) until `reset_after` seconds have passed; then one trial call (`probe_due()`, made
by a background thread, never by a request) half-opens it: its success closes the breaker, its failure
opens it again for twice as long (up to `max_reset_after`). One log line per change between usable and
not usable, never one per call.
"""

from __future__ import annotations

import logging
import threading
import time

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}  # the breaker-state gauge's values


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        log: logging.Logger,
        failure_threshold: int = 3,
        reset_after: float = 5.0,
        max_reset_after: float = 60.0,
        clock=time.monotonic,
    ) -> None:
        self.name = name
        self.log = log
        self.failure_threshold = failure_threshold
        self.base_reset_after = reset_after
        self.reset_after = reset_after
        self.max_reset_after = max_reset_after
        self.clock = clock
        self.state = CLOSED
        self.failures = 0  # in a row
        self.opened_at = 0.0
        self.times_opened = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """May a request's path call the service now? (Only while closed.)"""
        return self.state == CLOSED

    def probe_due(self) -> bool:
        """Open long enough: the caller makes one trial call now and reports it (the breaker is half-open)."""
        with self._lock:
            if self.state == OPEN and self.clock() - self.opened_at >= self.reset_after:
                self.state = HALF_OPEN
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            if self.state != CLOSED:
                self.state = CLOSED
                self.reset_after = self.base_reset_after
                self.log.warning("%s: reachable again; breaker closed, the store is used again", self.name)

    def failure(self, error: BaseException | str) -> None:
        with self._lock:
            self.failures += 1
            if self.state == HALF_OPEN:  # the trial failed: wait longer (quietly: still not usable)
                self.state = OPEN
                self.opened_at = self.clock()
                self.reset_after = min(2 * self.reset_after, self.max_reset_after)
                self.log.debug("%s: still failing (%s); next try in %.0f s", self.name, _brief(error), self.reset_after)
            elif self.state == CLOSED and self.failures >= self.failure_threshold:
                self.state = OPEN
                self.opened_at = self.clock()
                self.times_opened += 1
                self.log.warning(
                    "%s: %s; breaker open, requests compute without the store (next try in %.0f s)",
                    self.name,
                    _brief(error),
                    self.reset_after,
                )

    def trip(self, error: BaseException | str) -> None:
        """Open at once (a failure no retry can mend soon, e.g. at start-up)."""
        with self._lock:
            self.failures = self.failure_threshold - 1
        self.failure(error)

    @property
    def value(self) -> int:
        return STATE_VALUE[self.state]


def _brief(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"[:300]
    return str(error)[:300]
