"""GGUF files: their metadata as a transformers config (each family's fields and tensor names from its spec,
llmserve.model.registry), their tensors under Hugging Face names (GGUFTensors: read one at a time from the
file's memory map), and a float32 Hugging Face folder converted once for other servers."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import numpy as np
import torch

from llmserve import envs
from llmserve.model.config import ModelConfig
from llmserve.model.layers import head_order, head_rows, qkv_in_head_order
from llmserve.model.registry import (
    ARCHITECTURES,
    ArchSpec,
    config_from_hf,
    gguf_architectures,
    gguf_family,
)
from llmserve.model.specs.spec import GGUFMetadata, GGUFSpec

log = logging.getLogger("llmserve.loader")


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
        by_name = {t.name: t for t in reader.tensors}
        tensor = lambda n: np.array(by_name[n].data, dtype=np.float32).reshape(-1)  # noqa: E731
        meta = GGUFMetadata(g, frozenset(by_name), path, tensor)
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
    whole = ".".join(parts[2:])  # (a key naming the whole tensor: Granite 4.0-H's ssm_a, ssm_dt.bias)
    if len(parts) >= 3 and whole in spec.layer_names:
        return [(f"model.layers.{parts[1]}.{spec.layer_names[whole]}", None)]
    key = ".".join(parts[2:-1])  # (dotted for some: LFM2's shortconv.in_proj)
    if len(parts) < 4 or key not in spec.layer_names:
        return []
    leaf = spec.layer_names[key]
    if "{e}" in leaf:
        return [(f"model.layers.{parts[1]}.{leaf.format(e=e)}.{parts[-1]}", e) for e in range(experts)]
    return [(f"model.layers.{parts[1]}.{leaf}.{parts[-1]}", None)]


def _fast_reader():
    """gguf's GGUFReader, slicing the file's bytes as a plain array. The reader takes two slices per value of
    the metadata (a length and the bytes of each of a vocabulary's strings: ~200k for 49k tokens), and a slice
    of its np.memmap runs memmap's subclass hooks: 2.3-2.7 s for the bundled model's file, 0.6-0.7 s this way
    (same fields, same tensors; `reader.data` stays the memory map)."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if self.__dict__.get("_plain_of") is not self.data:
                self._plain, self._plain_of = self.data.view(np.ndarray), self.data
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = self._plain[offset:end].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader


def open_gguf(path: str):
    """gguf's GGUFReader over `path` (a memory map: nothing is read yet), refused with one error naming the
    file when it is truncated or corrupt or holds a tensor type llmserve cannot read."""
    from llmserve.model.kernels.gguf_kernels import BLOCKS, NAMES

    size = os.path.getsize(path)
    try:
        reader = _fast_reader()(path)
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
    1 + w), and so do the values a spec's `values` hook undoes (Granite 4.0-H's A_log). `read` lists the names
    read as float32 (tests)."""

    def __init__(self, path: str, reader, cfg: ModelConfig) -> None:
        self.path = path
        self.spec = gguf_arch(reader, path)[1].gguf
        self.cfg = cfg
        self._map = reader.data
        self._tensors: dict = {}  # Hugging Face name -> (the file's tensor, its expert or None)
        for t in reader.tensors:
            # GGUF lists the dimensions innermost first: a merged experts tensor's outermost is the experts (gpt-oss's
            # merged biases are 2-D)
            experts = int(t.shape[-1]) if len(t.shape) == 3 or (len(t.shape) == 2 and "_exps." in t.name) else 0
            for n, e in gguf_hf_names(t.name, self.spec, experts):
                self._tensors[n] = (t, e)
        self.read: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        from llmserve.model.kernels import gguf_kernels

        t, e = self._tensors[name]
        raw, num, K = self._raw(name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w = gguf_kernels.dequantize(raw, num, K).reshape(shape if e is None else shape[1:])
        if (heads := self._permuted_heads(name)) is not None:
            w = torch.from_numpy(np.ascontiguousarray(_unpermute(w.numpy(), heads)))
        if self.spec.norm_offset and name.endswith("norm.weight"):
            w = w - 1.0  # (the model adds the 1 back, as it does to a Hugging Face checkpoint's)
        if self.spec.values is not None:
            w = self.spec.values(name, w)
        self.release(name)
        self.read.append(name)
        return w

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def _raw(self, name: str) -> tuple[torch.Tensor, int, int]:
        """gguf_kernels.from_reader's (raw, qtype, K) of `name`: an expert's rows only."""
        from llmserve.model.kernels import gguf_kernels

        t, e = self._tensors[name]
        raw, num, K = gguf_kernels.from_reader(t)
        if e is not None:
            raw = raw.view(int(t.shape[-1]), -1, raw.shape[1])[e]
        return raw, num, K

    def _share(self, name: str) -> int:
        """How many Hugging Face tensors share `name`'s file tensor (the experts of a merged one)."""
        t, e = self._tensors[name]
        return 1 if e is None else int(t.shape[-1])

    def qtype(self, name: str) -> int:
        return int(self._tensors[name][0].tensor_type)

    def nbytes(self, name: str) -> int:
        return int(self._tensors[name][0].n_bytes) // self._share(name)

    def numel(self, name: str) -> int:
        return int(np.prod(self._tensors[name][0].shape)) // self._share(name)

    def _permuted_heads(self, name: str) -> int | None:
        # (the converter interleaves a biased Q / K's bias rows as it does the weight's: Granite with attention_bias)
        if self.spec.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            return self.cfg.num_heads if ".q_proj." in name else self.cfg.num_kv_heads
        return None

    def blocks(self, name: str) -> tuple[torch.Tensor, int]:
        """(raw uint8 [rows, row_bytes], GGMLQuantizationType number) with its rows in the model's order (the
        layer takes them as they are): in place, or a copy whose pages are handed back where the rows had to be
        reordered (llama files' interleaved Q / K rows; partial or interleaved rotary's layers.head_order)."""
        raw, num, _ = self._raw(name)
        perm = torch.arange(raw.shape[0])
        if (heads := self._permuted_heads(name)) is not None:
            perm = torch.from_numpy(_unpermute(perm.numpy(), heads))
        if (order := head_order(self.cfg)) is not None:
            if name.endswith("self_attn.qkv_proj.weight"):
                perm = qkv_in_head_order(perm, self.cfg, order)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                perm = head_rows(perm, order, self.cfg.head_dim)
        if not torch.equal(perm, torch.arange(raw.shape[0])):
            raw = raw[perm]
            self.release(name)
        return raw, num

    def keeps_blocks(self, name: str) -> bool:
        """Whether the model may hold `name` as the file's blocks: not where it scales the weights at load
        (Granite's residual multiplier, folded into o_proj, down_proj and Granite 4.0-H's mixers' out_proj:
        LlamaModel.adapt_weight), which blocks cannot take exactly; those are read as float32 (and rounded under
        --quantization)."""
        scaled = self.cfg.residual_multiplier != 1.0 and name.endswith(
            ("o_proj.weight", "down_proj.weight", "mamba.out_proj.weight")
        )
        return not scaled

    def release(self, name: str) -> None:
        """Hand the pages of a tensor that was copied back to the OS (they stay in the page cache): the
        copy is what the model holds, so resident memory does not count it twice."""
        import mmap

        mm = getattr(self._map, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or name not in self._tensors:
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
