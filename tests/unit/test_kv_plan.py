"""The KV plan (engine/kv_plan.py) from plain values, no model: each layer's cache kind, the budget, the window
split, the state slots, the disk tier's settings and the resulting max_model_len."""

from __future__ import annotations

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.kv_plan import (
    FullAttention,
    GiB,
    Memory,
    RecurrentState,
    SlidingWindow,
    kv_manager,
    plan,
)
from llmserve.model.memory import CgroupLimit

F32 = torch.float32


def full(n):
    return [FullAttention(3, 64, F32) for _ in range(n)]


def per_block(layers, bs=16):
    return sum(2 * bs * k.kv_heads * k.head_dim * 4 for k in layers if isinstance(k, FullAttention))


def test_num_kv_blocks_decides_and_max_model_len_follows_the_capacity():
    layers = full(4)
    p = plan(EngineConfig(num_kv_blocks=10), layers, Memory(), model_max=8192, token_budget=512)
    assert (p.num_blocks, p.budget_blocks, p.bytes_per_block) == (10, 10, per_block(layers))
    assert p.budget == 10 * per_block(layers)
    assert p.max_model_len == 160 and p.capacity == 160 and p.window is None and p.state_slots == 0
    assert p.lines == () and p.disk is None


def test_kv_cache_memory_and_the_model_positions_cap_max_model_len():
    layers = full(2)
    p = plan(EngineConfig(kv_cache_memory=0.5), layers, Memory(), model_max=1024, token_budget=512)
    assert p.num_blocks == int(0.5 * GiB) // per_block(layers) and p.max_model_len == 1024


def test_cpu_budget_is_a_quarter_of_the_available_memory_at_most_8_gib_with_a_log_line():
    layers = full(2)
    limit = CgroupLimit("/sys/fs/cgroup/x", 4 * GiB, 2 * GiB)
    p = plan(EngineConfig(), layers, Memory("cpu", 2 * GiB, 0, limit), model_max=1024, token_budget=512)
    assert p.budget == GiB // 2 and p.num_blocks == (GiB // 2) // per_block(layers)
    assert "a quarter of the 2.00 GiB available (under the cgroup memory limit of 4.00 GiB" in p.lines[0]
    big = plan(EngineConfig(), layers, Memory("cpu", 100 * GiB), model_max=1024, token_budget=512)
    assert big.budget == 8 * GiB and "the host's RAM" in big.lines[0]


def test_cuda_budget_takes_the_activations_off():
    layers = full(2)
    p = plan(EngineConfig(), layers, Memory("cuda", 3 * GiB, GiB), model_max=1024, token_budget=512)
    assert p.budget == 2 * GiB


def test_refusals_name_the_flag():
    with pytest.raises(ValueError, match="holds no block"):
        plan(EngineConfig(kv_cache_memory=1e-6), full(2), Memory(), model_max=1024, token_budget=512)
    with pytest.raises(ValueError, match="do not fit in the KV cache"):
        plan(EngineConfig(num_kv_blocks=4, max_model_len=100), full(2), Memory(), model_max=1024, token_budget=64)


def test_recurrent_state_slots_come_out_of_the_budget():
    state = RecurrentState(((2, 64),), F32)
    layers = [state, FullAttention(2, 16, F32), state, FullAttention(2, 16, F32)]
    cfg = EngineConfig(kv_cache_memory=0.01, max_num_seqs=64, enable_prefix_caching=False)
    p = plan(cfg, layers, Memory(), model_max=4096, token_budget=512)
    slot = 2 * (2 * 64 * 4)
    assert p.state_slots == 64 and p.state_shapes == [((2, 64),), None, ((2, 64),), None]
    assert p.num_blocks == (int(0.01 * GiB) - 64 * slot) // per_block(layers)
    assert "2 of 4 layers keep a recurrent state: a pool of 64 slots" in p.lines[0]
    kv = kv_manager(p)
    assert kv.states.num_slots == 64 and kv.window is None and kv.num_blocks == p.num_blocks
    with pytest.raises(ValueError, match="leaves no KV block"):
        plan(EngineConfig(kv_cache_memory=5e-5, max_num_seqs=64), layers, Memory(), model_max=4096, token_budget=512)


def test_sliding_window_layers_get_their_own_pool_unless_a_setting_keeps_every_block():
    layers = [SlidingWindow(3, 64, F32, 128)] * 5 + [FullAttention(3, 64, F32)]
    cfg = EngineConfig(num_kv_blocks=100, max_model_len=1024)
    p = plan(cfg, layers, Memory(), model_max=8192, token_budget=64)
    assert p.window is not None and p.window.window == 128
    assert p.window_layers == [True] * 5 + [False]
    assert p.num_blocks + 5 * p.window.num_blocks <= 600 and p.budget_blocks == 100
    assert "5 of 6 layers attend to a window of 128" in p.lines[0]
    kv = kv_manager(p)
    assert kv.window.num_blocks == p.window.num_blocks and kv.num_blocks == p.num_blocks
    for kw, why in ((dict(kv_cache_dir="/tmp/x"), "--kv-cache-dir"), (dict(tensor_parallel_size=2), "tensor")):
        kept = plan(EngineConfig(num_kv_blocks=100, **kw), layers, Memory(), model_max=8192, token_budget=64)
        assert kept.window is None and kept.num_blocks == 100 and why in kept.lines[0]
    off = EngineConfig(num_kv_blocks=100, disable_hybrid_kv_cache_manager=True)
    assert plan(off, layers, Memory(), model_max=8192, token_budget=64).window is None


def test_disk_tier_settings_or_a_warning(tmp_path):
    layers = full(3)
    p = plan(  # (the engine plans with --quantization resolved: loader.mode)
        EngineConfig(num_kv_blocks=8, kv_cache_dir=str(tmp_path), kv_cache_dir_size=2.0, quantization="none"),
        layers,
        Memory(),
        model_max=512,
        token_budget=64,
    )
    assert p.disk.root == str(tmp_path) and p.disk.max_bytes == 2 * GiB
    assert p.disk.settings == dict(
        format=1, quantization="none", kv_dtype="float32", block_size=16, layers=3, kv_heads=3, head_dim=64
    )
    off = EngineConfig(num_kv_blocks=8, kv_cache_dir=str(tmp_path), enable_prefix_caching=False)
    q = plan(off, layers, Memory(), model_max=512, token_budget=64)
    assert q.disk is None and "needs prefix caching" in q.warnings[0]


def test_store_tier_shares_the_disk_tiers_settings_or_a_warning(tmp_path):
    layers = full(3)
    url = "redis://127.0.0.1:6379/0"
    cfg = EngineConfig(num_kv_blocks=8, kv_cache_url=url, kv_cache_dir=str(tmp_path), quantization="int8")
    p = plan(cfg, layers, Memory(), model_max=512, token_budget=64)
    assert p.store.url == url and p.store.timeout == 0.5 and p.store.password_file is None
    assert p.store.settings == p.disk.settings and p.store.settings["quantization"] == "int8"
    off = EngineConfig(num_kv_blocks=8, kv_cache_url=url, speculative_model="x", num_speculative_tokens=2)
    q = plan(off, layers, Memory(), model_max=512, token_budget=64)
    assert q.store is None and "kv store: --kv-cache-url ignored" in q.warnings[0]
    assert p.for_draft(3, 3, 64).store is None


def test_a_draft_plan_takes_the_budget_in_one_pool():
    layers = [SlidingWindow(3, 64, F32, 128)] * 5 + [FullAttention(3, 64, F32)]
    p = plan(EngineConfig(num_kv_blocks=100), layers, Memory(), model_max=8192, token_budget=64)
    d = p.for_draft(4, 1, 32)
    assert d.num_blocks == 100 and d.window is None and not d.enable_caching and len(d.layers) == 4
