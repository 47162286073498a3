"""`session`: consistent hashing of a session key (a header or the `user` field) on a ring with virtual
nodes: stable when a backend joins or leaves."""

from __future__ import annotations

import bisect
import hashlib

from .base import REASON_LEAST_LOADED, Backend, Decision, Policy, RouteRequest

REASON_SESSION = "session"


def _hash64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes. Keys move only to or from a backend that joins or
    leaves; all other keys keep their backend."""

    def __init__(self, nodes: list[str] = (), vnodes: int = 160):
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        for n in nodes:
            self.add(n)

    def add(self, node: str) -> None:
        for v in range(self.vnodes):
            h = _hash64(f"{node}#{v}")
            i = bisect.bisect(self._points, h)
            self._points.insert(i, h)
            self._owners.insert(i, node)

    def remove(self, node: str) -> None:
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def lookup(self, key: str, allowed: set[str] | None = None) -> str | None:
        """The first node clockwise from the key's hash, skipping nodes not in `allowed`."""
        if not self._points:
            return None
        start = bisect.bisect(self._points, _hash64(key))
        n = len(self._points)
        for k in range(n):
            owner = self._owners[(start + k) % n]
            if allowed is None or owner in allowed:
                return owner
        return None


class Session(Policy):
    """Requests with the same session key go to the same backend. The ring holds every backend
    the policy has seen (healthy or not), and a lookup skips the ones not among the candidates,
    so an ejected backend's sessions move to their ring successors and come back on
    re-admission, while all other sessions stay put. Requests without a key fall back to
    least outstanding."""

    name = "session"

    def __init__(self, use_metrics: bool = False, vnodes: int = 160):
        super().__init__(use_metrics)
        self.ring = HashRing(vnodes=vnodes)
        self._members: set[str] = set()

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        for b in candidates:
            if b.url not in self._members:
                self._members.add(b.url)
                self.ring.add(b.url)
        if not req.session_key:
            return Decision(self.least_loaded(candidates), REASON_LEAST_LOADED)
        by_url = {b.url: b for b in candidates}
        url = self.ring.lookup(req.session_key, set(by_url))
        return Decision(by_url[url], REASON_SESSION)

    def on_backend_removed(self, backend: Backend) -> None:
        if backend.url in self._members:
            self._members.discard(backend.url)
            self.ring.remove(backend.url)
