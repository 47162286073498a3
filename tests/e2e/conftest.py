"""Servers that several e2e files share (one start-up each for the whole session)."""

from __future__ import annotations

import os

import pytest

from llmserve.testing.launcher import ServerProcess

API_KEY = "sk-apis"


@pytest.fixture(scope="session")
def reasoning_server():
    """The bundled model as "x" with an API key and the qwen3 reasoning parser: the Responses and
    Messages API tests (test_responses.py, test_messages.py)."""
    with ServerProcess(
        "--num-threads",
        "1",
        "--served-model-name",
        "x",
        "--api-key",
        API_KEY,
        "--reasoning-parser",
        "qwen3",
        "--max-model-len",
        "1024",
    ) as srv:
        yield srv.wait_ready()


@pytest.fixture(scope="session")
def ollama_server():
    """The bundled model as "smol" (Ollama's `smol:latest`), max-model-len 512: the Ollama API tests, on the
    wire (test_ollama.py) and through the ollama client and langchain-ollama (test_ollama_client.py)."""
    port = int(os.environ.get("LLMSERVE_TEST_PORT", "0")) or None
    with ServerProcess("--num-threads", "1", "--served-model-name", "smol", "--max-model-len", "512", port=port) as srv:
        yield srv.wait_ready()
