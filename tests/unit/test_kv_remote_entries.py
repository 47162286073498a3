"""The shared store's entries and decisions (llmserve/engine/kv_remote.py), without a store: keys name the
model and the block, an entry is trusted only whole, of this model and block, with its checksum; the
break-even fetches only runs long enough to beat recomputing them; URLs are logged without passwords."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.kv_remote import BreakEven, block_key, pack_block, unpack_block
from llmserve.engine.kv_store_client import command_packer, connect, unreachable
from llmserve.store_url import check_url, client_url, cluster_nodes, is_cluster, redacted

FP = bytes(range(32))
OTHER = bytes(32)
NAME = bytes.fromhex("00112233445566778899aabbccddeeff")


def test_a_key_names_the_model_and_the_block():
    key = block_key(FP, NAME)
    assert key == b"llmserve:kv:" + FP.hex()[:32].encode() + b":" + NAME.hex().encode()
    assert block_key(OTHER, NAME) != key and block_key(FP, NAME[::-1]) != key


def test_an_entry_is_trusted_only_when_everything_checks_out():
    payload = bytes(range(256)) * 8
    entry = pack_block(FP, NAME, payload)
    assert unpack_block(entry, FP, NAME, len(payload)) == payload
    assert unpack_block(None, FP, NAME, len(payload)) is None
    assert unpack_block(pack_block(OTHER, NAME, payload), FP, NAME, len(payload)) is None  # another model's
    assert unpack_block(pack_block(FP, NAME[::-1], payload), FP, NAME, len(payload)) is None  # another block
    assert unpack_block(entry[:-1], FP, NAME, len(payload)) is None  # torn
    assert unpack_block(entry + b"x", FP, NAME, len(payload)) is None
    flipped = bytearray(entry)
    flipped[-10] ^= 1
    assert unpack_block(bytes(flipped), FP, NAME, len(payload)) is None  # the checksum
    assert unpack_block(entry, FP, NAME, len(payload) + 1) is None  # another block size


def test_the_break_even_skips_runs_too_short_to_pay():
    be = BreakEven(block_size=16, block_bytes=1_000_000)
    assert be.min_blocks() == 1  # nothing measured: fetch
    be.round_trip(0.010)  # 10 ms a call
    be.fetched(0.010 + 0.001, 1_000_000)  # 1 ms a block beyond it
    be.step(0.64, 640)  # 1 ms a token: 16 ms to recompute a block, 15 ms saved per block fetched
    assert be.min_blocks() == 1
    be.rtt = 0.100  # a far store: 100 ms a round trip needs 7 blocks (7 x 15 ms > 100 ms)
    assert be.min_blocks() == 7
    be.seconds_per_token = 0.00005  # a fast accelerator: 0.8 ms a block, below the 1 ms transfer
    assert be.min_blocks() is None
    be.step(0.5, 8)  # a decode step says nothing about prefill
    assert be.seconds_per_token == 0.00005


@pytest.mark.parametrize(
    "url, want",
    [
        ("valkey://h:6379/0", "redis://h:6379/0"),
        ("valkeys://h:6380", "rediss://h:6380"),
        ("rediss://h:6380/2", "rediss://h:6380/2"),
    ],
)
def test_valkey_urls_are_redis_urls(url, want):
    assert client_url(url) == want


def test_urls_are_logged_without_their_password():
    assert redacted("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted("rediss://user:s3cret@h:6380") == "rediss://user:***@h:6380"
    assert redacted("redis://h:6379") == "redis://h:6379"


@pytest.mark.parametrize(
    "url, want",
    [
        ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001", [("10.0.0.1", 7000), ("10.0.0.2", 7001)]),
        ("rediss+cluster://:pw@h1:7000, h2/0?ssl_ca_certs=/ca.pem", [("h1", 7000), ("h2", 6379)]),
        ("valkey+cluster://user:pw@[::1]:7000,[fe80::2]", [("::1", 7000), ("fe80::2", 6379)]),
    ],
)
def test_a_cluster_url_lists_its_seed_nodes(url, want):
    check_url(url)
    assert is_cluster(url) and cluster_nodes(url) == want


def test_store_urls_that_cannot_work_are_refused_with_the_reason():
    for good in ("redis://h:6379/0", "valkeys://h", "redis+cluster://h:7000"):
        check_url(good)
        assert is_cluster(good) == good.startswith("redis+")
    with pytest.raises(ValueError, match="redis\\+cluster://"):
        check_url("memcached://h:11211")
    with pytest.raises(ValueError, match="must be redis://"):
        check_url("redis+sentinel://h:26379")
    with pytest.raises(ValueError, match="one database"):
        check_url("redis+cluster://h:7000/3")
    with pytest.raises(ValueError, match="not HOST:PORT"):
        check_url("redis+cluster://h:7000,:7001")
    with pytest.raises(ValueError, match="not HOST:PORT"):
        check_url("redis+cluster://h:port")
    assert client_url("valkeys+cluster://h:7000") == "rediss+cluster://h:7000"
    assert redacted("redis+cluster://:s3cret@h1:7000,h2:7001") == "redis+cluster://:***@h1:7000,h2:7001"


def test_a_cluster_unreachable_at_start_is_a_connection_error_not_a_crash():
    """The client is made on first use: connecting to no cluster fails as a refused connection does (the
    breaker opens at once), not with redis-py's RedisClusterException."""
    import redis

    from llmserve.testing.launcher import free_port

    client = connect(f"redis+cluster://127.0.0.1:{free_port()}", None, 0.5)
    with pytest.raises(redis.ConnectionError) as e:
        client.ping()
    assert unreachable(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_an_entry_of_a_tensor_is_the_entry_of_its_bytes(dtype):
    block = (torch.arange(2 * 3 * 16 * 64) % 97).to(dtype).view(2, 3, 16, 64)
    entry = pack_block(FP, NAME, block)
    assert entry == pack_block(FP, NAME, block.contiguous().view(torch.uint8).numpy().tobytes())
    payload = unpack_block(bytes(entry), FP, NAME, block.numel() * block.element_size())
    assert torch.equal(torch.frombuffer(bytearray(payload), dtype=dtype).view(block.shape), block)


def test_a_block_is_sent_to_the_store_as_it_is_not_copied_into_the_command():
    value = bytearray(700_000)
    chunks = command_packer().pack("SET", b"llmserve:kv:x", value)
    assert any(c is value for c in chunks)  # the entry itself goes to the socket
    client = connect("redis://127.0.0.1:6379/0", None, 0.5)
    assert isinstance(client.connection_pool.connection_kwargs["command_packer"], type(command_packer()))
