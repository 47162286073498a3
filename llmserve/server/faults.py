"""Fault injection: a test facility, off unless LLMSERVE_FAULT_INJECTION=1 (docs/reliability.md).

A prompt holding FAULT_REQUEST_MARKER fails that request alone (a 500); one holding FAULT_LOOP_MARKER
kills the engine loop, and the process exits 1.
"""

from __future__ import annotations

import logging

log = logging.getLogger("llmserve.server")

FAULT_REQUEST_MARKER = "LLMSERVE-INJECT-REQUEST-FAULT"  # fails that request alone (a 500)
FAULT_LOOP_MARKER = "LLMSERVE-INJECT-LOOP-FAULT"  # kills the engine loop (the process exits 1)


class InjectedLoopFault(BaseException):
    """Not an Exception, so the engine's per-request isolation does not catch it: the loop dies."""


def install_fault_injection(engine) -> None:
    """Set the engine's fault hook (`engine` is an AsyncEngine)."""
    log.warning(
        "LLMSERVE_FAULT_INJECTION=1: prompts containing %s fail, prompts containing %s kill "
        "the engine loop (a test facility; never set this in production)",
        FAULT_REQUEST_MARKER,
        FAULT_LOOP_MARKER,
    )
    tok, seen = engine.tokenizer, {}

    def hook(r) -> None:
        kind = seen.get(r.request_id)
        if kind is None:
            text = tok.decode(r.prompt_token_ids, skip_special_tokens=False)
            kind = seen[r.request_id] = (
                "loop" if FAULT_LOOP_MARKER in text else "request" if FAULT_REQUEST_MARKER in text else ""
            )
            if len(seen) > 100_000:
                seen.clear()
        if kind == "request" and r.num_output_tokens >= 1:
            raise RuntimeError("injected fault in one request's processing")
        if kind == "loop":
            raise InjectedLoopFault("injected fault in the engine loop")

    engine.engine.fault_hook = hook
