"""Schemathesis over the server's /openapi.json, shared by tests/e2e/test_fuzz.py (CI, bounded) and
benchmarks/serving/fuzz_schemathesis.py (a long run against a live server): generated bodies get a small token
budget, so that a 2-core CPU answers them in seconds."""

from __future__ import annotations


def clamp_budget(body, path: str = "", most: int = 4) -> None:
    """Keep generations short, in place: a positive max_tokens (the Responses API's max_output_tokens, Ollama's
    options.num_predict) above `most` becomes `most`; none given becomes `most`."""
    if isinstance(body, dict) and path in ("/api/chat", "/api/generate"):  # Ollama's: options.num_predict
        opts = body.get("options")
        if isinstance(opts, dict):
            v = opts.get("num_predict")
            if not isinstance(v, int) or isinstance(v, bool) or v > most or v < 0:
                opts["num_predict"] = most
        elif opts is None:
            body["options"] = {"num_predict": most}
        return
    if isinstance(body, dict) and path != "/v1/embeddings":
        keys = ("max_output_tokens",) if path == "/v1/responses" else ("max_tokens", "max_completion_tokens")
        for k in keys:
            v = body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > most:
                body[k] = most
        if not any(k in body for k in keys):
            body[keys[0]] = most
