"""--models-dir's pieces without a server: the folder scan and models.yaml (llmserve/serve_config.py), Ollama's
keep_alive values (server/models_dir.parse_keep_alive) and a slot's expiry."""

from __future__ import annotations

import pytest

from llmserve.config import EngineConfig
from llmserve.serve_config import ModelsDirSettings, scan_models_dir
from llmserve.server.models_dir import FOREVER, parse_keep_alive


def _folder(tmp_path, yaml_text: str | None = None):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    (tmp_path / "no-config").mkdir()  # a folder without config.json: not a model
    (tmp_path / "readme.md").write_text("x")
    if yaml_text is not None:
        (tmp_path / "models.yaml").write_text(yaml_text)
    return tmp_path


def test_scan_names_models_by_stem_with_their_settings(tmp_path):
    d = _folder(tmp_path, "a:\n  quantization: int8\n  kv-cache-memory: 0.5\nb:\n  chat-template: t.jinja\n")
    entries = scan_models_dir(str(d), EngineConfig.field_names())
    assert [e.name for e in entries] == ["a", "b"]
    a, b = entries
    assert a.path == str(d / "a.gguf") and a.engine == {"quantization": "int8", "kv_cache_memory": 0.5}
    assert b.path == str(d / "b") and b.engine == {} and b.server == {"chat_template": "t.jinja"}


@pytest.mark.parametrize(
    "text, words",
    [
        ("c:\n  dtype: float32\n", "not a model"),
        ("a:\n  port: 1\n", "not a per-model setting"),
        ("a:\n  model: x.gguf\n", "the file and the name"),
        ("- a\n", "must map model names"),
        ("a: 3\n", "must be a mapping"),
    ],
)
def test_bad_models_yaml_is_refused_naming_the_entry(tmp_path, text, words):
    with pytest.raises(ValueError, match=words):
        scan_models_dir(str(_folder(tmp_path, text)), EngineConfig.field_names())


def test_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="models_max"):
        ModelsDirSettings(models_max=0)
    with pytest.raises(ValueError, match="not a folder"):
        ModelsDirSettings(models_dir=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "value, seconds",
    [
        (None, None),
        (0, 0.0),
        (30, 30.0),
        (2.5, 2.5),
        ("45", 45.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("10s", 10.0),
        (-1, FOREVER),
        ("-1", FOREVER),
        ("-5m", FOREVER),
    ],
)
def test_keep_alive_values(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m5", True, "1d"])
def test_bad_keep_alive_names_the_field(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)
