"""The served models as Ollama names and describes them: `name:tag` names (`tagged`; `resolve` the other way), how
long a model stays loaded once idle (`keep_alive`, with --models-dir), and what /api/tags, /api/show and /api/ps
list of each (`entries`, `running`: details, model_info, size, digest, expires_at), for a loaded model and for a
--models-dir file not loaded yet (from its GGUF metadata)."""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timezone

from llmserve.server.errors import APIError, from_value_error
from llmserve.server.models_dir import FOREVER, parse_keep_alive
from llmserve.server.state import ServerState

NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at of a model that is never unloaded


def resolve(state: ServerState, name: str) -> str:
    """The served name an Ollama name (`name:tag`, `:latest` optional) stands for; unknown: 404."""
    base = name.removesuffix(":latest")
    try:
        return state.check_model(base)
    except APIError:
        if base != name:
            return state.check_model(name)
        raise


def keep_alive(state: ServerState, value) -> float | None:
    """Checks a request's keep_alive (a 400 naming it) and, with --models-dir, sets how long its model stays
    loaded once idle (0: unloaded as soon as the request is answered)."""
    try:
        seconds = parse_keep_alive(value)
    except ValueError as e:
        raise from_value_error(e) from e
    if state.slot is not None:  # (as Ollama: a request without it goes back to the default)
        state.slot.keep_alive = seconds
    return seconds


def tagged(name: str) -> str:
    """An Ollama model name: `name:latest` unless it has a tag."""
    return name if ":" in name else f"{name}:latest"


def _disk(path: str) -> tuple[int, float]:
    """(bytes, newest mtime) of a model file or folder."""
    if os.path.isfile(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime
    size, mtime = 0, 0.0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.stat(os.path.join(root, f))
            except OSError:
                continue
            size, mtime = size + st.st_size, max(mtime, st.st_mtime)
    return size, mtime


def parameter_count(mc) -> int:
    """The decoder's parameters, from its configuration (quantized weights are packed: counting tensors
    would not give it)."""
    attn = mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    if mc.num_experts:
        mlp = 3 * mc.hidden_size * mc.moe_intermediate_size * mc.num_experts + mc.hidden_size * mc.num_experts
    else:
        mlp = 3 * mc.hidden_size * mc.intermediate_size
    embed = mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
    return embed + mc.num_layers * (attn + mlp + 2 * mc.hidden_size) + mc.hidden_size


def size_label(n: int) -> str:
    """Ollama's parameter_size (its format.HumanNumber): 8B, 3.2B, 134.52M, 135M, 22K."""
    for unit, scale, digits in (("B", 10**9, 1), ("M", 10**6, 2)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.{digits}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def family(mc) -> str:
    kind = getattr(mc.hf_config, "model_type", None)
    return kind or mc.architecture.lower().removesuffix("forcausallm")


_FILE_FACTS: dict[tuple, object] = {}  # (path, size, mtime) -> GGUFFacts or None, read once per file version


def _file_facts(path: str, size: int, mtime: float):
    """A GGUF file's facts (its metadata only: a memory map, no weights read); None for a folder or a bad file."""
    key = (path, size, mtime)
    if key not in _FILE_FACTS:
        facts = None
        if path.endswith(".gguf"):
            from llmserve.model.loader.gguf import open_gguf
            from llmserve.model.loader.gguf_facts import gguf_facts

            try:
                facts = gguf_facts(open_gguf(path))
            except (ValueError, OSError):
                facts = None  # (loading it says why)
        _FILE_FACTS[key] = facts
    return _FILE_FACTS[key]


def describe_file(path: str) -> dict:
    """What /api/tags says of a model of --models-dir that is not loaded: its file's size, digest and date, and
    a GGUF file's family, parameter size and quantization level from its metadata."""
    size, mtime = _disk(path)
    facts = _file_facts(path, size, mtime)
    return {
        "size": size,
        "digest": hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest(),
        "modified_at": rfc3339(mtime or 0),
        "details": {
            "parent_model": "",
            "format": "gguf" if path.endswith(".gguf") else "safetensors",
            "family": facts.architecture if facts else "",
            "families": [facts.architecture] if facts else None,
            "parameter_size": size_label(facts.parameter_count) if facts else "",
            "quantization_level": facts.file_type if facts else "",
        },
    }


# the weights' dtype as Ollama names an unquantized model's quantization_level
_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def describe(engine) -> dict:
    """What /api/tags, /api/show and /api/ps say of the served model (`engine`: the LLMEngine). The digest
    is of the path, size and mtime, not of the content (hashing gigabytes on a listing is not worth it)."""
    cached = getattr(engine, "_ollama_description", None)
    if cached is not None:
        return cached
    mc = engine.model_config
    size, mtime = _disk(engine.model_path)
    facts = getattr(engine, "gguf_facts", None)  # a GGUF file's own type and count (model/loader/gguf_facts.py)
    gguf = facts is not None
    if gguf:
        quant, fam, params = facts.file_type, facts.architecture or family(mc), facts.parameter_count
    else:
        quant = engine.config.quantization or _DTYPES.get(str(engine.dtype), str(engine.dtype))
        fam, params = family(mc), parameter_count(mc)
    families = [fam, "clip"] if getattr(engine.source, "mmproj", None) else [fam]
    desc = {
        "size": size,
        "digest": hashlib.sha256(f"{engine.model_path}:{size}:{mtime}".encode()).hexdigest(),
        "modified_at": rfc3339(mtime or 0),
        "details": {
            "parent_model": "",
            "format": "gguf" if gguf else "safetensors",
            "family": fam,
            "families": families,
            "parameter_size": size_label(params),
            "quantization_level": quant.upper(),
        },
        "model_info": {
            "general.architecture": fam,
            "general.parameter_count": params,
            f"{fam}.context_length": engine.max_model_len,
            f"{fam}.embedding_length": mc.hidden_size,
            f"{fam}.block_count": mc.num_layers,
            f"{fam}.attention.head_count": mc.num_heads,
            f"{fam}.attention.head_count_kv": mc.num_kv_heads,
            f"{fam}.vocab_size": mc.vocab_size,
        },
    }
    engine._ollama_description = desc
    return desc


# -- the listings ---------------------------------------------------------------------------------------------------
def entries(state: ServerState) -> list[tuple[str, dict]]:
    if state.models is not None:  # --models-dir: every model of the folder (failed ones left out)
        return [
            (
                tagged(s.name),
                describe(s.state.engine.engine) if s.state.engine is not None else describe_file(s.entry.path),
            )
            for s in state.models.slots.values()
            if s.status != "failed"
        ]
    eng = state.engine_or_503()
    return [(tagged(n), describe(eng.engine)) for n in state.model_names]


def running(state: ServerState) -> list[tuple[str, dict, object, str]]:
    """(name, description, LLMEngine, expires_at) of each loaded model."""
    if state.models is not None:
        pool = state.models
        out = []
        for s in pool.loaded():
            t = s.expires_at(pool.idle_timeout)
            out.append(
                (
                    tagged(s.name),
                    describe(s.state.engine.engine),
                    s.state.engine.engine,
                    NEVER if t == FOREVER else rfc3339(t),
                )
            )
        return out
    eng = state.engine_or_503()
    return [(tagged(n), describe(eng.engine), eng.engine, NEVER) for n in state.model_names]
