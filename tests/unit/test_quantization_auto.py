"""`--quantization auto` (llmserve/model/loader/mode.py): a quantized GGUF is served on its own blocks by default,
everything else on float weights; the refusals of `--quantization gguf`; the mode's log line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from llmserve.config import EngineConfig
from llmserve.model.loader.mode import resolve_quantization, weight_mode

Q4KM = ["Q4_K", "Q6_K"]


@pytest.fixture
def blocks_on(monkeypatch):
    monkeypatch.setenv("LLMSERVE_GGUF_BLOCKS", "1")


def test_auto_serves_a_quantized_gguf_on_its_blocks(blocks_on):
    mode, why = resolve_quantization("auto", gguf=True, block_types=Q4KM, device="cpu")
    assert mode == "gguf"
    assert "Q4_K/Q6_K" in why and "--quantization none --dtype float32" in why


@pytest.mark.parametrize(
    "kw,reason",
    [
        (dict(gguf=False, block_types=[], device="cpu"), "float weights"),  # a Hugging Face folder
        (dict(gguf=True, block_types=[], device="cpu"), "float weights"),  # an F16 / BF16 GGUF
        (dict(gguf=True, block_types=Q4KM, device="cuda"), "cuda widens"),
        (dict(gguf=True, block_types=Q4KM, device="cpu", tensor_parallel_size=2), "tensor parallelism"),
        (dict(gguf=True, block_types=Q4KM, device="cpu", vision=True), "vision"),
    ],
)
def test_auto_keeps_float_weights_elsewhere(blocks_on, kw, reason):
    mode, why = resolve_quantization("auto", **kw)
    assert mode is None and reason in why


def test_switch_off_keeps_the_exact_default(monkeypatch):
    monkeypatch.setenv("LLMSERVE_GGUF_BLOCKS", "0")
    mode, why = resolve_quantization("auto", gguf=True, block_types=Q4KM, device="cpu")
    assert mode is None and "LLMSERVE_GGUF_BLOCKS=0" in why


@pytest.mark.parametrize("asked", [None, "int8", "int4"])
def test_an_explicit_mode_is_kept(blocks_on, asked):
    assert resolve_quantization(asked, gguf=True, block_types=Q4KM, device="cpu")[0] == asked


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(gguf=False, block_types=[], device="cpu"), "has none"),
        (dict(gguf=True, block_types=[], device="cpu"), "has none"),
        (dict(gguf=True, block_types=Q4KM, device="cuda"), "runs on CPU"),
        (dict(gguf=True, block_types=Q4KM, device="cpu", tensor_parallel_size=2), "tensor parallelism"),
    ],
)
def test_gguf_mode_refused_where_it_cannot_run(kw, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_quantization("gguf", **kw)


def test_config_takes_the_modes_and_refuses_others():
    assert EngineConfig().quantization == "auto"
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig(quantization="gguf").quantization == "gguf"
    assert EngineConfig(quantization="w8a8").quantization == "w8a8"
    assert EngineConfig(quantization="auto", tensor_parallel_size=2).quantization == "auto"  # resolves to none
    with pytest.raises(ValueError, match="auto, none, gguf, int8, w8a8, int4"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(quantization="int4", tensor_parallel_size=2)


def test_weight_mode_replaces_the_config_and_logs_why(blocks_on, caplog):
    from gguf import GGMLQuantizationType as T

    reader = SimpleNamespace(
        tensors=[
            SimpleNamespace(shape=(256, 64), tensor_type=T.Q4_K),
            SimpleNamespace(shape=(256, 64), tensor_type=T.Q4_K),
            SimpleNamespace(shape=(64, 256), tensor_type=T.Q6_K),
            SimpleNamespace(shape=(64,), tensor_type=T.F32),
            SimpleNamespace(shape=(64, 64), tensor_type=T.F16),
        ]
    )
    source = SimpleNamespace(kind="gguf")
    mc = SimpleNamespace(mm_config=None)
    cpu = SimpleNamespace(type="cpu")
    with caplog.at_level(logging.INFO, logger="llmserve.loader"):
        cfg = weight_mode(EngineConfig(), source, reader, mc, cpu)
    assert cfg.quantization == "gguf"
    assert "--quantization auto -> gguf: the file's own Q4_K/Q6_K blocks" in caplog.text
    exact = EngineConfig(quantization="none", dtype="float32")
    assert weight_mode(exact, source, reader, mc, cpu) is exact
