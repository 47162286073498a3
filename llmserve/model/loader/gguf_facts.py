"""What a GGUF file says of itself beside its weights, for the Ollama API's model descriptions and defaults:
its architecture, its file type as llama.cpp and Ollama name it (`quantization_level`: Q4_1, Q4_K_M, Q8_0,
BF16, ...), its parameter count (its tensors' elements, as Ollama counts them) and the sampling its maker
recommends (llama.cpp's `general.sampling.*` keys, in Ollama's option names)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# general.sampling.<key> -> Ollama's option
_SAMPLING = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repeat_penalty",
    "penalty_last_n": "repeat_last_n",
}
# llama.cpp's LlamaFileType names that Ollama writes otherwise
_NAMES = {"ALL_F32": "F32", "MOSTLY_MXFP4_MOE": "MXFP4"}


@dataclass(frozen=True)
class GGUFFacts:
    architecture: str
    file_type: str  # Q4_1, Q4_K_M, F16, ... ("" when neither the metadata nor the tensors tell)
    parameter_count: int
    sampling: dict = field(default_factory=dict)  # Ollama option -> value


def _value(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def file_type_name(number) -> str | None:
    """llama.cpp's name of a `general.file_type` (3: Q4_1, 15: Q4_K_M); None for an unknown or guessed one."""
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(int(number)).name
    except (TypeError, ValueError):
        return None
    return None if name == "GUESSED" else _NAMES.get(name, name.removeprefix("MOSTLY_"))


def _commonest_type(reader) -> str:
    """A file without general.file_type: its matrices' commonest tensor type (Q4_K, Q8_0, F16, ...)."""
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return kinds.most_common(1)[0][0] if kinds else ""


def gguf_facts(reader) -> GGUFFacts | None:
    """The facts of an open GGUF file (gguf.GGUFReader), None when `reader` is None (a Hugging Face folder)."""
    if reader is None:
        return None
    sampling = {}
    for key, option in _SAMPLING.items():
        v = _value(reader, f"general.sampling.{key}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            sampling[option] = int(v) if option in ("top_k", "repeat_last_n") else round(float(v), 6)
    return GGUFFacts(
        architecture=str(_value(reader, "general.architecture") or ""),
        file_type=file_type_name(_value(reader, "general.file_type")) or _commonest_type(reader),
        parameter_count=sum(int(t.n_elements) for t in reader.tensors),
        sampling=sampling,
    )
