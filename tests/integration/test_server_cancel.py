"""A client that goes away aborts its engine request, even when the cancellation lands just as an
output arrives (Python 3.11's asyncio.wait_for drops such a cancellation: the request then ran to its
end with nobody reading, seen as a flaky test_disconnect_aborts)."""

from __future__ import annotations

import asyncio
import time

from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.request import SamplingParams
from llmserve.server.api.completions import CompletionRendering, CompletionRequest
from llmserve.server.serving import Generation
from llmserve.server.state import ServerSettings, ServerState


class _CancelOnToken:
    """Stands in for ServerMetrics' one counter that Generation.events touches: the first streamed token
    schedules the consumer's cancellation, so it lands while that token travels to the consumer."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self._n = 0

    @property
    def tokens_streamed(self) -> int:
        return self._n

    @tokens_streamed.setter
    def tokens_streamed(self, n: int) -> None:
        if self._n == 0 and n > 0:
            asyncio.get_running_loop().call_soon(self.task.cancel)
        self._n = n


def test_cancel_as_an_output_arrives_aborts_the_engine_request(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    free_before = engine.kv.num_free_blocks
    aeng = AsyncEngine(engine)
    try:
        state = ServerState(ServerSettings())
        state.metrics = counter = _CancelOnToken()
        ids = engine.tokenizer.encode("Tell me a long story about the sea.")
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
        seen: list = []

        async def main():
            runs = [(0, 0, ids, params)]
            body = CompletionRequest(prompt=ids, max_tokens=400)
            gen = Generation(
                state, aeng, "cancel-test", runs, 0, "m", None, CompletionRendering(aeng.tokenizer, runs, body)
            )

            async def consume():
                async for ev in gen.events():
                    seen.append(ev)

            counter.task = asyncio.create_task(consume())
            try:
                await counter.task
            except asyncio.CancelledError:
                return True
            return False

        assert asyncio.run(main()), "the consumer ran to its end: the cancellation was lost"
        assert len([e for e in seen if e is not None]) <= 1
        deadline = time.time() + 10
        while engine.has_unfinished_requests() and time.time() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished_requests(), "the engine request was not aborted"
    finally:
        aeng.shutdown()
    assert engine.kv.num_free_blocks == free_before
