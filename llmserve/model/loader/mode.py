"""Which weight mode a checkpoint is served in: `--quantization auto` (the default) resolved once, at start-up.

Defaults are the fast path, exactness is a flag. A GGUF file whose matrices are quantized (Q4_0 .. Q8_0,
K-quants, IQ4, MXFP4) is served by default as llama.cpp serves it: `gguf`, every quantized tensor on its own
blocks with integer dots (activations rounded per block, as llama.cpp rounds them), float tensors kept
float. Its quality is judged against llama.cpp's own output on the same file (docs/engine.md, "Weight
modes"), not against a float32 model. `--quantization none --dtype float32` keeps the float32-exact mode
(greedy output equal to transformers' on the same weights). Everything else (a Hugging Face folder, a
float GGUF, CUDA, tensor parallelism, a vision-language model) resolves to `none`.

LLMSERVE_GGUF_BLOCKS=0 makes `auto` pick `none` for a GGUF too (the test suite's parity default, as
LLMSERVE_CPU_BF16=0 keeps `--dtype auto` at float32)."""

from __future__ import annotations

import dataclasses
import logging

from llmserve import envs
from llmserve.model.loader.gguf_model import FLOAT_TYPES

log = logging.getLogger("llmserve.loader")


def quantized_types(reader) -> list[str]:
    """The block formats (Q4_K, Q6_K, MXFP4, ...) of an open GGUF file's matrices, commonest first."""
    if reader is None:
        return []
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) > 1 and int(t.tensor_type) not in FLOAT_TYPES:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return sorted(counts, key=lambda k: -counts[k])


def resolve_quantization(
    asked: str | None,
    *,
    gguf: bool,
    block_types: list[str],
    device: str,
    tensor_parallel_size: int = 1,
    vision: bool = False,
) -> tuple[str | None, str]:
    """(the mode, why): `asked` is --quantization (auto | none/None | gguf | int8 | int4); `gguf`: the model is
    a GGUF file, `block_types` its quantized matrices' formats; `device`: cpu | cuda. Raises ValueError for a
    mode the model cannot take."""
    if asked == "gguf":
        if not gguf or not block_types:
            raise ValueError(
                "quantization: gguf serves a GGUF file's own quantized blocks; this model has none "
                "(a Hugging Face folder or a float GGUF): use --quantization int8 or int4"
            )
        if device != "cpu":
            raise ValueError("quantization: gguf (the file's own blocks) runs on CPU; on CUDA leave --quantization out")
        if tensor_parallel_size > 1 or vision:
            raise ValueError("quantization: gguf is not supported with tensor parallelism or a vision model yet")
        return "gguf", "asked for"
    if asked != "auto":
        return asked, "asked for" if asked else "asked for (--quantization none: the exact mode)"
    if not gguf or not block_types:
        return None, "the checkpoint holds float weights"
    why = None
    if device != "cpu":
        why = f"{device} widens a GGUF's blocks to its dtype"
    elif tensor_parallel_size > 1:
        why = "tensor parallelism shards float weights"
    elif vision:
        why = "vision-language models are served unquantized"
    elif not envs.LLMSERVE_GGUF_BLOCKS:
        why = "LLMSERVE_GGUF_BLOCKS=0"
    if why is not None:
        return None, f"the file's {'/'.join(block_types)} blocks widened ({why})"
    return "gguf", (
        f"the file's own {'/'.join(block_types)} blocks with llama.cpp's integer dots, as llama-server serves it "
        "(--quantization none --dtype float32: the float32-exact mode)"
    )


def weight_mode(config, source, reader, mc, device):
    """`config` (an EngineConfig) with its --quantization resolved for the model at `source` (a resolved model
    source, `reader` its open GGUF file or None, `mc` its ModelConfig) on `device`; logs the mode and why."""
    mode, why = resolve_quantization(
        config.quantization,
        gguf=source.kind == "gguf",
        block_types=quantized_types(reader),
        device=device.type,
        tensor_parallel_size=config.tensor_parallel_size,
        vision=mc.mm_config is not None,
    )
    log.info("weights: --quantization %s -> %s: %s", config.quantization or "none", mode or "none", why)
    return config if mode == config.quantization else dataclasses.replace(config, quantization=mode)
