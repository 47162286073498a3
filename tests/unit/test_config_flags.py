"""Engine flags generated from EngineConfig, the environment read in one place, and which module may
import which (no CLI imports the server's; ops.py does not import quant.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from llmserve import envs
from llmserve.config import EngineConfig, KernelConfig, add_engine_arguments, engine_config_from_args, flag_dests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(argv)


def test_no_flags_give_the_default_config():
    assert engine_config_from_args(parse([])) == EngineConfig()


def test_every_flagged_field_has_its_flag_and_the_rest_have_none():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    dests = {a.dest: a for a in p._actions}
    for f in dataclasses.fields(EngineConfig):
        assert (f.name in dests) == ("help" in f.metadata), f.name
    assert "kernels" not in dests and "enforce_eager" not in dests
    assert dests["dtype"].choices == ["auto", "float32", "bfloat16", "float16"]
    assert dests["quantization"].default == "auto"
    assert isinstance(dests["enable_prefix_caching"], argparse.BooleanOptionalAction)
    assert dests["kv_cache_memory"].type is float and dests["max_num_seqs"].type is int


def test_kv_cache_dtype_choices_and_the_8_bit_types():
    """--kv-cache-dtype: the dtypes, int8 and vLLM's fp8 names; an unknown type refused naming the field; fp8
    only where the hardware has FP8 (never on a CPU), with a message pointing at int8."""
    import torch

    from llmserve.model.loader import resolve_kv_dtype

    assert engine_config_from_args(parse(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parse(["--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown"):
        EngineConfig(kv_cache_dtype="int4")
    assert resolve_kv_dtype("int8", torch.float32, torch.device("cpu")) is torch.int8
    assert resolve_kv_dtype("fp16", torch.float32) is torch.float16
    for name in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match="fp8 needs FP8 hardware.*int8"):
            resolve_kv_dtype(name, torch.float32, torch.device("cpu"))


def test_flags_and_aliases_reach_the_config():
    cfg = engine_config_from_args(
        parse(
            [
                "-tp",
                "2",
                "--seed",
                "7",
                "--quantization",
                "none",
                "--no-enable-prefix-caching",
                "--kv-cache-memory",
                "0.5",
            ]
        )
    )
    assert (cfg.tensor_parallel_size, cfg.seed, cfg.quantization, cfg.enable_prefix_caching, cfg.kv_cache_memory) == (
        2,
        7,
        None,
        False,
        0.5,
    )
    assert cfg.kernels == KernelConfig()
    with pytest.raises(SystemExit):
        parse(["--dtype", "float64"])
    assert flag_dests(["-tp", "2", "--max-num-seqs=3", "--model", "m.gguf"]) == {
        "tensor_parallel_size",
        "max_num_seqs",
        "model",
    }


def test_yaml_settings_yield_to_flags_also_to_aliases(tmp_path):
    from llmserve.server.cli import _apply_config_file, add_arguments

    path = tmp_path / "s.yaml"
    path.write_text("max-num-seqs: 8\ntensor-parallel-size: 1\nblock-size: 32\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--config", str(path), "-tp", "2", "--max-num-seqs", "4"]
    args = p.parse_args(argv)
    _apply_config_file(args, flag_dests(argv))
    assert (args.tensor_parallel_size, args.max_num_seqs, args.block_size) == (2, 4, 32)


def test_envs_reads_at_each_access(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    assert envs.LLMSERVE_CACHE_DIR == str(tmp_path)
    monkeypatch.delenv("LLMSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.LLMSERVE_CACHE_DIR == os.path.join(str(tmp_path), "llmserve")
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    assert envs.LLMSERVE_CPU_KERNELS is False
    monkeypatch.delenv("RANK", raising=False)
    assert envs.RANK is None
    with pytest.raises(AttributeError):
        envs.LLMSERVE_NO_SUCH_VARIABLE  # noqa: B018


# modules that pass the environment on to child processes, and the bench client's OPENAI_API_KEY default
PASS_ON = {
    "llmserve/bench/cli.py",
    "llmserve/bench/fakeserver.py",
    "llmserve/router/fake_backend.py",
    "llmserve/testing/launcher.py",
}


def test_only_envs_reads_the_environment():
    readers = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "llmserve")):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py"):
                with open(path) as f:
                    if "os.environ" in f.read():
                        readers.add(os.path.relpath(path, ROOT))
    assert readers - PASS_ON == {"llmserve/envs.py"}


def test_layering_of_imports():
    """The CLIs build their flags without the server's CLI module; the kernels' seam (ops) does not
    know the quantized layers' module."""
    code = """
import argparse, sys
from llmserve.engine import cli, cli_chat
from llmserve.router import launch
for m in (cli, cli_chat, launch):
    m.add_arguments(argparse.ArgumentParser())
assert "llmserve.server.cli" not in sys.modules, "a CLI imports llmserve.server.cli"
import torch
from llmserve.model.kernels import ops
ops.head_screen(torch.randn(8, 32))
assert "llmserve.model.formats.quant" not in sys.modules, "ops imports quant"
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_lora_flags_as_vllm_names_them():
    from llmserve.engine.lora import parse_lora_modules

    cfg = engine_config_from_args(
        parse(["--lora-modules", "sql=/a/sql", "poet=/b", "--max-loras", "2", "--max-lora-rank", "8"])
    )
    assert cfg.enable_lora and cfg.lora_modules == ["sql=/a/sql", "poet=/b"]
    assert (cfg.max_loras, cfg.max_lora_rank) == (2, 8)
    assert parse_lora_modules(cfg.lora_modules) == [("sql", "/a/sql"), ("poet", "/b")]
    assert engine_config_from_args(parse(["--enable-lora"])).enable_lora
    assert not EngineConfig().enable_lora
    with pytest.raises(ValueError, match="is not name=path"):
        parse_lora_modules(["sql"])
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(max_loras=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)


def test_runtime_lora_updating_variable(monkeypatch):
    monkeypatch.delenv("LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert envs.LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING is False
    for value, want in (("1", True), ("True", True), ("0", False), ("", False)):
        monkeypatch.setenv("LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert envs.LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING is want
