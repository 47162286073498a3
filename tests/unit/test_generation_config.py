"""--generation-config / --override-generation-config: the model's sampling defaults, read as vLLM reads them."""

from __future__ import annotations

import json

import pytest

from llmserve.config import EngineConfig
from llmserve.engine.generation_config import default_sampling


def folder_with(tmp_path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_reads_the_model_folder_and_keeps_only_sampling_keys(tmp_path):
    f = folder_with(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2, "max_new_tokens": 9})
    assert default_sampling("auto", f, {}) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 9}
    assert default_sampling("auto", None, {}) == {}  # a GGUF file: no generation config
    assert default_sampling("auto", str(tmp_path / "missing"), {}) == {}


def test_vllm_ignores_the_file_and_overrides_apply_in_every_mode(tmp_path):
    f = folder_with(tmp_path, {"temperature": 0.6, "repetition_penalty": 1.1})
    assert default_sampling("vllm", f, {}) == {}
    assert default_sampling("vllm", f, {"temperature": 0.2}) == {"temperature": 0.2}
    assert default_sampling("auto", f, {"temperature": 0.2}) == {"temperature": 0.2, "repetition_penalty": 1.1}


def test_a_folder_of_its_own(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    assert default_sampling(folder_with(other, {"min_p": 0.05}), None, {}) == {"min_p": 0.05}
    with pytest.raises(ValueError, match="generation_config"):
        default_sampling(str(tmp_path / "nowhere"), None, {})


def test_bad_values_are_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="generation_config.*top_p"):
        default_sampling("auto", folder_with(tmp_path, {"top_p": 3}), {})
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config"):
        default_sampling("auto", str(tmp_path), {})


def test_override_flag_parsing():
    assert EngineConfig(override_generation_config='{"temperature": 0.5}').override_generation_config == {
        "temperature": 0.5
    }
    assert EngineConfig(override_generation_config={"top_k": 3}).override_generation_config == {"top_k": 3}
    assert EngineConfig().override_generation_config == {}
    for bad in ("{nope", "[1]", '{"temprature": 1}'):
        with pytest.raises(ValueError, match="override_generation_config"):
            EngineConfig(override_generation_config=bad)


def test_served_model_names_and_max_logprobs():
    assert EngineConfig(served_model_name="a").served_model_name == ["a"]
    assert EngineConfig(served_model_name=["a", "b"]).served_model_name == ["a", "b"]
    with pytest.raises(ValueError, match="served_model_name"):
        EngineConfig(served_model_name=[])
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig(max_logprobs=-2)
