"""Shared fixtures (the bundled model, a transformers reference, cached engines), and the layer markers:
every test under tests/unit, tests/integration or tests/e2e gets the marker `unit`, `integration` or
`e2e` (registered in pyproject.toml), so that `pytest -m unit` runs the fast model-free layer."""

from __future__ import annotations

import gc
import os
import sys
from collections import OrderedDict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# greedy parity is checked in float32 on every machine kind: `--dtype auto` must not pick bfloat16 where the
# CPU has it (tests/integration/test_bf16.py turns it back on)
os.environ.setdefault("LLMSERVE_CPU_BF16", "0")
# ... and `--quantization auto` must not serve the bundled GGUF on its own blocks (integer dots): the same parity
# default; tests/integration/test_weight_mode.py turns it back on
os.environ.setdefault("LLMSERVE_GGUF_BLOCKS", "0")

LAYERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    tests_dir = os.path.join(ROOT, "tests")
    for item in items:
        layer = os.path.relpath(str(item.path), tests_dir).split(os.sep)[0]
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))


@pytest.fixture(scope="session")
def bundled_gguf() -> str:
    from llmserve.model.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_model(bundled_gguf):
    """transformers' own float32 load of the bundled GGUF: the correctness reference."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(bundled_gguf), gguf_file=os.path.basename(bundled_gguf), torch_dtype=torch.float32
    )
    return model.eval()


_ENGINES: OrderedDict = OrderedDict()
# the most engines kept at once: each holds its KV pool (often 1 GiB) and weights, and a session that
# kept every settings' engine reached 17 GiB and the OOM killer on a 23 GiB machine
_MAX_ENGINES = 3


@pytest.fixture(scope="session")
def llm_factory():
    """LLM instances cached by their settings (the most recently used few): loading costs seconds, tests
    share them. An engine dropped from the cache is freed once no fixture or test holds it."""

    def make(**kwargs):
        from llmserve import LLM

        key = tuple(sorted(kwargs.items()))
        if key in _ENGINES:
            _ENGINES.move_to_end(key)
            return _ENGINES[key]
        while len(_ENGINES) >= _MAX_ENGINES:
            _ENGINES.popitem(last=False)
            gc.collect()
        _ENGINES[key] = LLM(**kwargs)
        return _ENGINES[key]

    yield make
    _ENGINES.clear()


@pytest.fixture(scope="session")
def llm(llm_factory):
    return llm_factory(max_num_batched_tokens=256, kv_cache_memory=1.0)
