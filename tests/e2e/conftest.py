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


@pytest.fixture(scope="session")
def redis_store():
    """A Redis-protocol store for --kv-cache-url tests: Debian's redis-server, started here on a loopback port
    (a throwaway folder, nothing saved); without the binary, the store .ci/run started
    (LLMSERVE_TEST_REDIS_URL), else the test is skipped."""
    from llmserve.testing.redis_server import RedisServer, redis_binary

    if redis_binary() is None:
        url = os.environ.get("LLMSERVE_TEST_REDIS_URL")
        if not url:
            pytest.skip("no redis-server (apt-get install redis-server) and no LLMSERVE_TEST_REDIS_URL")
        yield url
        return
    with RedisServer() as store:
        yield store.url


@pytest.fixture
def redis_factory():
    """Stores of a test's own (a password, a tiny maxmemory, one to kill): `make(**RedisServer kwargs)`,
    all stopped after the test; skipped without the redis-server binary."""
    from llmserve.testing.redis_server import RedisServer, redis_binary

    if redis_binary() is None:
        pytest.skip("no redis-server binary (apt-get install redis-server)")
    made = []

    def make(**kwargs):
        made.append(RedisServer(**kwargs).start())
        return made[-1]

    yield make
    for store in made:
        store.stop()


@pytest.fixture
def redis_cluster():
    """A real Redis Cluster of three primaries on loopback ports (Debian's redis-server in cluster mode, joined
    by `redis-cli --cluster create`); skipped without the binaries."""
    import shutil

    from llmserve.testing.redis_server import RedisClusterStore, redis_binary

    if redis_binary() is None or shutil.which("redis-cli") is None:
        pytest.skip("no redis-server / redis-cli binary (apt-get install redis-server): no Redis Cluster to test")
    with RedisClusterStore(3) as cluster:
        yield cluster
