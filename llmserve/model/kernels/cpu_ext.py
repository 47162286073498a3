"""The CPU kernels' extension module (llmserve/csrc/, built once per process with torch's C++ extension builder,
cached under ~/.cache/torch_extensions) and the process-wide settings it runs under: `KernelConfig`
(llmserve/config.py, `configure`), the float32 GEMM engine (`gemm_engine`) and the GEMV / GEMM crossovers
(`gemm_rows`). A leaf: ops.py (the model layer's seam to the kernels) and gguf_kernels.py both load the
extension through `cpu_kernels()` here, and neither imports the other's loader.
"""

from __future__ import annotations

import functools
import glob
import logging
import os

import torch
import torch.nn.functional as F

from llmserve import envs
from llmserve.config import KernelConfig

log = logging.getLogger("llmserve.ops")

_EXT = None
_TRIED = False
_KERNELS = KernelConfig()


@functools.cache
def cpu_has_int8_dots() -> bool:
    """Whether this CPU sums int8 products into int32 directly (AVX512-VNNI, AVX-VNNI or AMX). Without them oneDNN's
    u8 x s8 matmul (the packed int8 weights' path) adds pairs of products in int16 with saturation (vpmaddubsw):
    activations shifted to u8 overflow it and the sums come out wrong (seen on a Zen 2, 1 row: -2.11 for -3.80), so
    there the plain weights stay on the integer dots, which sum exactly. Nor does torch's _int_mm run fast there:
    its fallback took 9.1 ms for 16 rows x 576 x 1536 against float32's 0.7 ms on that Zen 2 (36 ms vs 1.5 at 64
    rows), so many rows take the float32 tiles instead (KernelConfig.int8_gemm)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def configure(kernels: KernelConfig) -> KernelConfig:
    """Use `kernels`' settings from now on (process-wide); returns the previous ones. Quantized layers
    take their row limits when built: configure before loading a model (the engine does)."""
    global _KERNELS
    previous, _KERNELS = _KERNELS, kernels
    if kernels != previous:  # GEMV / GEMM crossovers measured under other settings (engine, rows) are stale
        _CROSSOVERS.clear()
    if _EXT is not None and kernels.gemm != previous.gemm:
        _EXT.set_gemm_engine(gemm_engine() == "onednn")
    if _EXT is not None:
        _EXT.set_q8_int_gemm(kernels.int8_gemm and cpu_has_int8_dots())
        _EXT.set_q4_vnni(kernels.int4_vnni)
        _set_kquant_panels(kernels)
    return previous


def _set_kquant_panels(kernels: KernelConfig) -> None:
    """The row counts from which the GGUF blocks' many-row kernels run into the module: the K-quant panels
    (envs.LLMSERVE_KQUANT_PANELS, KernelConfig.kquant_panel_rows) and Q8_0's integer GEMM (q8_block_gemm_rows)."""
    _EXT.set_kquant_panels(kernels.kquant_panel_rows if envs.LLMSERVE_KQUANT_PANELS else 1 << 62)
    _EXT.set_q8_block_rows(kernels.q8_block_gemm_rows)


def kernel_config() -> KernelConfig:
    """The settings in force."""
    return _KERNELS


def cpu_kernels():
    """The compiled extension module, or None where it cannot be used (built once per process)."""
    global _EXT, _TRIED
    if _TRIED:
        return _EXT
    _TRIED = True
    if not envs.LLMSERVE_CPU_KERNELS:
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("cpu kernels: this CPU lacks AVX2; using PyTorch ops")
        return None
    try:
        from torch.utils.cpp_extension import load

        csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "csrc")
        _EXT = load(
            name="llmserve_cpu_ops",
            sources=sorted(glob.glob(os.path.join(csrc, "*.cpp"))),  # one module; headers tracked by ninja
            verbose=False,
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        _EXT.set_avx512(bool(envs.LLMSERVE_AVX512))
        _EXT.set_avx512_twin(envs.LLMSERVE_AVX512 == "twin")
        _EXT.set_vnni_twin(envs.LLMSERVE_VNNI == "twin")
        _EXT.set_amx(envs.LLMSERVE_AMX != "0", envs.LLMSERVE_AMX == "twin")
        _EXT.set_gemm_engine(gemm_engine() == "onednn")
        _EXT.set_q8_int_gemm(_KERNELS.int8_gemm and cpu_has_int8_dots())
        _EXT.set_q4_vnni(_KERNELS.int4_vnni)
        _set_kquant_panels(_KERNELS)
    except Exception as e:  # no compiler, no ninja: the PyTorch ops do the same work, slower
        log.warning("cpu kernels: could not build llmserve/csrc/*.cpp (%s); using PyTorch ops", e)
        _EXT = None
    return _EXT


def fast(x: torch.Tensor):
    """The extension where it runs on `x` (float32, CPU), else None."""
    if x.dtype is not torch.float32 or x.is_cuda:
        return None
    return _EXT if _TRIED else cpu_kernels()


_GEMM_MEASURED: str | None = None


def gemm_engine() -> str:
    """The float32 GEMM the many-rows paths use: "onednn" (torch's mkldnn::_linear_pointwise) or "aten"
    (at::linear: MKL's sgemm in torch's CPU build). KernelConfig.gemm when set; else measured once per process on
    a prefill-sized matmul (MKL keeps to its AVX2 code on AMD CPUs, oneDNN runs AVX-512: 2-2.4x here; on other
    CPUs MKL may win). Greedy tokens do not depend on it beyond float32 rounding of the sums' order."""
    global _GEMM_MEASURED
    if _KERNELS.gemm is not None:
        return _KERNELS.gemm
    if _GEMM_MEASURED is None:
        _GEMM_MEASURED = _measure_gemm()
        log.info("float32 GEMM: %s (measured)", _GEMM_MEASURED)
    return _GEMM_MEASURED


def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _measure_gemm(repeats: int = 5) -> str:
    """The faster of at::linear and oneDNN on 128 x 1024 @ 1024 x 2048 (best of `repeats`, interleaved)."""
    import time

    if not torch.backends.mkldnn.is_available():
        return "aten"
    x, w = torch.randn(128, 1024), torch.randn(2048, 1024)
    best = {"aten": float("inf"), "onednn": float("inf")}
    try:
        with torch.inference_mode():
            for rep in range(repeats + 1):
                for name, fn in (("aten", F.linear), ("onednn", _onednn_linear)):
                    t = time.perf_counter()
                    fn(x, w)
                    if rep:
                        best[name] = min(best[name], time.perf_counter() - t)
    except Exception as e:  # an odd build without the op: at::linear
        log.info("float32 GEMM: oneDNN's matmul unavailable (%s)", e)
        return "aten"
    return "onednn" if best["onednn"] < best["aten"] * 0.9 else "aten"


_CROSSOVERS: dict[tuple, int] = {}  # (N, K, threads) -> rows from which at::linear wins (measured)


def gemm_rows(weight: torch.Tensor, packed: torch.Tensor | None = None) -> int:
    """The number of rows from which the GEMM (`gemm_engine`: MKL's or oneDNN's) beats the extension's GEMV for this
    float32 weight: KernelConfig.gemv_rows + 1 when set, else measured once per shape and thread count
    (`calibrate_gemv`). The GEMV reads the weights once per 4 rows (8 with AVX-512), the GEMM once per call but with a
    start-up cost and packing: where they cross depends on the shape (N * K against the caches) and on
    the CPU (AVX2 vs AVX-512 GEMM)."""
    fixed = _KERNELS.gemv_rows
    if fixed is not None:
        return fixed + 1
    if weight.shape[1] % 8 or cpu_kernels() is None:
        return 0
    key = (weight.shape[0], weight.shape[1], torch.get_num_threads(), packed is not None)
    rows = _CROSSOVERS.get(key)
    if rows is None:
        rows = _CROSSOVERS[key] = calibrate_gemv(weight, _KERNELS.calibration_rows, gemm_weight=packed)
        log.debug("float32 %s x %s: GEMV below %d rows, at::linear from there", key[0], key[1], rows)
    return rows


def calibrate_gemv(
    weight: torch.Tensor, rows: tuple[int, ...], repeats: int = 3, gemm_weight: torch.Tensor | None = None
) -> int:
    """The first of `rows` from which the GEMM (on `gemm_weight`, the packed copy, where given) is faster than
    the GEMV on `weight` at that row count and the next (each the best of `repeats` interleaved runs: robust to
    a busy machine's stalls); past the largest, the GEMM. Costs a few GEMV passes per shape (~0.1-1 s for a 1B
    model's shapes)."""
    import time

    ext = cpu_kernels()
    w = weight.detach()
    gw = w if gemm_weight is None else gemm_weight
    wins = 0
    first = None
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, w.shape[1])
            best = [float("inf"), float("inf")]
            for rep in range(repeats + 1):
                for i in (0, 1):
                    t = time.perf_counter()
                    if i == 0:
                        ext.f32_linear(x, w, m + 1)
                    else:
                        ext.gemm(x, gw)
                    if rep:  # the first round warms up
                        best[i] = min(best[i], time.perf_counter() - t)
            if best[1] < best[0]:
                wins += 1
                first = m if wins == 1 else first
                if wins == 2:
                    return first
            else:
                wins, first = 0, None
    return first if first is not None else rows[-1] + 1
