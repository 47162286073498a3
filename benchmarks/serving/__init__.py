"""Serving benchmarks: `llmserve serve` and `llmserve route` over HTTP (the articles' procedure, the soak,
the router)."""
