"""What every routing policy shares: the backend as the router sees it (`Backend`), the request's routing
facts (`RouteRequest`), the answer (`Decision`: a backend and the reason, a metric label) and `Policy`, the
interface (choose; hear what was routed and which backends left) with its least-loaded helper.

Policies are pure selection logic: no network, no asyncio, no clock. The router hands a policy the
request's routing facts and the backends that may take it (healthy, serving the model, not saturated, not
already tried); the policy answers with one backend and the reason it chose it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the reason of a least-loaded choice, as it appears in metrics (each policy names its other reasons)
REASON_LEAST_LOADED = "least_outstanding"


@dataclass(eq=False)
class Backend:
    """One upstream server as the router sees it. Identity is the object (`eq=False`)."""

    url: str
    models: set[str] = field(default_factory=set)
    models_declared: bool = False  # models come from config, not from /v1/models
    model_cards: dict[str, dict] = field(default_factory=dict)  # the backend's /v1/models entries
    weight: float = 1.0
    min_prompt_tokens: int = 0
    max_prompt_tokens: int | None = None  # None: no upper bound
    max_outstanding: int | None = None  # None: router default
    source: str = "static"  # static | yaml | dns:<name>
    # live state, updated by the router and the health checker
    healthy: bool = False
    ever_healthy: bool = False
    ejected_reason: str | None = "not checked yet"
    outstanding: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # load scraped from the backend's /metrics (None until scraped)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    # the blocks the backend's KV cache holds, from its GET /kv_events (None: it publishes no events)
    kv_blocks: set[str] | None = None
    kv_block_size: int = 16
    kv_events_seq: int = -1  # the last event read
    kv_events_instance: str | None = None  # ... from this engine process

    def load(self, use_metrics: bool = False) -> float:
        """Requests in flight, as the router counts them, or as the backend reports them when
        metrics are scraped and show more (other clients, other routers)."""
        n = float(self.outstanding)
        if use_metrics and self.running is not None:
            n = max(n, (self.running or 0.0) + (self.waiting or 0.0))
        return n / max(self.weight, 1e-9)

    def takes_length(self, prompt_tokens: int) -> bool:
        if prompt_tokens < self.min_prompt_tokens:
            return False
        return self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens

    def __repr__(self) -> str:  # short, for logs
        return f"Backend({self.url}, healthy={self.healthy}, outstanding={self.outstanding})"


@dataclass
class RouteRequest:
    """What a policy may look at: no body, no headers beyond the session key."""

    model: str | None = None
    prompt_text: str = ""  # prompt, or the chat messages flattened
    prompt_tokens: int = 0  # an estimate (characters / chars_per_token)
    max_tokens: int | None = None
    session_key: str | None = None
    stream: bool = False
    token_ids: list[int] | None = None  # the prompt as the backends tokenize it (asked when some publish KV events)


@dataclass
class Decision:
    backend: Backend
    reason: str


class Policy:
    name = "base"

    def __init__(self, use_metrics: bool = False):
        self.use_metrics = use_metrics

    def choose(self, req: RouteRequest, candidates: list[Backend]) -> Decision:
        raise NotImplementedError

    def on_routed(self, req: RouteRequest, backend: Backend) -> None:
        """Called once the request was handed to `backend` (first attempt or a retry)."""

    def on_backend_removed(self, backend: Backend) -> None:
        """Called when discovery drops a backend for good."""

    # shared helper: least loaded, ties broken in turn so equal backends share the work
    _tie = 0

    def least_loaded(self, candidates: list[Backend]) -> Backend:
        loads = [b.load(self.use_metrics) for b in candidates]
        low = min(loads)
        tied = [b for b, x in zip(candidates, loads) if x == low]
        if len(tied) == 1:
            return tied[0]
        self._tie += 1
        return tied[self._tie % len(tied)]
