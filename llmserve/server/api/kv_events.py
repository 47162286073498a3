"""GET /kv_events (with --kv-events-config): the engine's KV block events, for a router that routes on what
each replica really holds (vLLM publishes the same events over ZMQ; here a reader pulls them over HTTP).

`?after=SEQ` answers the events after sequence number SEQ: `{"seq", "block_size", "hash", "reset", "events":
[{"seq", "type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", "block_hashes": [hex, ...]}]}`. A reader
that starts (`after=-1`) or has fallen behind the log gets `reset: true` and a snapshot of every cached block.
Block names are `llmserve.engine.kv_events.chain_digests` of the blocks' token ids.
"""

from __future__ import annotations

from fastapi import APIRouter, Query

from llmserve.engine.kv_events import parse_kv_events_config
from llmserve.server import protocol as P
from llmserve.server.errors import APIError
from llmserve.server.state import ServerState, State

router = APIRouter()


def enabled(state: ServerState) -> bool:
    return parse_kv_events_config(state.settings.engine.kv_events_config) is not None


@router.get("/kv_events", summary="KV cache block events after a sequence number", responses=P.ERROR_RESPONSES)
async def kv_events(state: State, after: int = Query(-1, description="the last sequence number read; -1: a snapshot")):
    eng = state.engine_or_503()
    log = eng.engine.kv.events
    if log is None:
        raise APIError(404, "KV events are off (start with --kv-events-config)")
    return log.since(after)
