"""Every environment variable llmserve reads, with its default and meaning (as vLLM's vllm/envs.py).

Other modules never read `os.environ` themselves; they ask this one, when the value is needed (so a
variable set after import still counts):

    from llmserve import envs
    if envs.LLMSERVE_CPU_KERNELS: ...

Settings a user chooses per run are flags (EngineConfig, `llmserve serve --help`); variables are for
what must reach a process before or beside its flags: test facilities, caches, launchers' conventions.
Tests also read LLMSERVE_CHROMIUM (tests/e2e/test_web_page.py: the browser to drive, default
/usr/bin/chromium); nothing in the package does.
"""

from __future__ import annotations

import os
from typing import Any, Callable


def _cache_dir() -> str:
    return os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmserve"
    )


def _int_or_none(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value is None else int(value)


environment_variables: dict[str, Callable[[], Any]] = {
    # -- llmserve's own --------------------------------------------------------------------------
    # "0": run the model on plain PyTorch ops; llmserve/csrc/ is not built (default: used where
    # the CPU has AVX2 and a compiler exists). Read once per process, when the kernels are first asked for.
    "LLMSERVE_CPU_KERNELS": lambda: os.environ.get("LLMSERVE_CPU_KERNELS", "1") != "0",
    # "0": the CPU kernels keep to AVX2 + FMA where the CPU also has AVX-512 (default: the AVX-512 variants of
    # the float32 GEMV and the int8 dots run where cpuid reports AVX-512 F/BW/DQ/VL).
    # "twin": those variants run their portable twins, on any CPU and in place of the instructions: the same float
    # operations in the same order, the same bits (slow: the tests run an AVX-512 CPU's default path on every CPU
    # with it; the VNNI kernels follow LLMSERVE_VNNI)
    "LLMSERVE_AVX512": lambda: {"0": False, "twin": "twin"}.get(os.environ.get("LLMSERVE_AVX512", "1"), True),
    # "0": no native bfloat16 on CPU: `--dtype auto` stays float32 and `--dtype bfloat16` runs plain PyTorch ops
    # in bfloat16 (default: where oneDNN reports AVX512-BF16 or AMX, bfloat16 weights run through its bf16 matmul
    # with float32 activations, llmserve/model/formats/bf16.py, and auto picks them). The test suite sets "0": greedy
    # parity is checked in float32 on every machine kind.
    # "emulate": the bfloat16 mode on any CPU through its portable twin (bfloat16 rows and weights, products summed
    # in float32 by PyTorch's own matmul, the output rounded to bfloat16): the tests run the default path of
    # bf16 CPUs on every CPU with it.
    "LLMSERVE_CPU_BF16": lambda: {"0": False, "emulate": "emulate"}.get(os.environ.get("LLMSERVE_CPU_BF16", "1"), True),
    # a bfloat16 model's fresh prompt chunk of attention.BF16_PREFILL_MIN+ tokens: "auto" (default) attends in bfloat16
    # through SDPA where the CPU has AMX-BF16 tiles (oneDNN's bf16 there: 14 vs 27 ms a 3B layer at 1,000 tokens on a
    # Sapphire Rapids), else in float32 through llmserve's own flash kernel (a Zen 4's AVX512-BF16 SDPA took 1.8-2.0 s
    # of a 3B 1,000-token prefill's attention, the float32 kernel 1.0 s); "1": always; "0": never
    "LLMSERVE_BF16_ATTENTION": lambda: os.environ.get("LLMSERVE_BF16_ATTENTION", "auto"),
    # "0": GGUF's K-quant dots of many rows stay row by row (default: from KernelConfig.kquant_panel_rows rows on, the
    # weights packed into panels of 16 rows, where the VNNI kernels run: csrc/gguf_panels.cpp)
    "LLMSERVE_KQUANT_PANELS": lambda: os.environ.get("LLMSERVE_KQUANT_PANELS", "1") != "0",
    # "twin": the kernels chosen on AVX-512 VNNI (the int8 / int4 integer GEMMs of csrc/vnni.cpp, the K-quant panels)
    # run their portable twins, on any CPU and in place of the instructions: the same integers and float operations,
    # the same bits (slow: the tests run a VNNI CPU's default path on every CPU with it). Default: the instructions
    # where the CPU has them (and LLMSERVE_AVX512 allows), else those kernels do not run
    "LLMSERVE_VNNI": lambda: os.environ.get("LLMSERVE_VNNI", "1"),
    # "0": the int8 integer GEMM of many rows (q8_vnni_gemm, `--quantization int8`) stays on the VNNI kernel where the
    # CPU also has AMX (default: from 64 rows on AMX-INT8 tiles, the same sums: llmserve/csrc/amx.h). "twin": that
    # path with the tiles' portable twin, on any CPU where the VNNI kernels run (with LLMSERVE_VNNI=twin: any CPU)
    "LLMSERVE_AMX": lambda: os.environ.get("LLMSERVE_AMX", "1"),
    # "0": `--quantization auto` widens a quantized GGUF (float32-exact, or bfloat16 by --dtype) instead of serving
    # its own blocks (llmserve/model/loader/mode.py); the test suite's parity default, as LLMSERVE_CPU_BF16=0
    "LLMSERVE_GGUF_BLOCKS": lambda: os.environ.get("LLMSERVE_GGUF_BLOCKS", "1") != "0",
    # images in requests (llmserve/server/media.py): seconds to fetch an http(s) image (vLLM's
    # VLLM_IMAGE_FETCH_TIMEOUT), the most bytes of an encoded image, the most pixels of a decoded one
    "LLMSERVE_IMAGE_FETCH_TIMEOUT": lambda: float(os.environ.get("LLMSERVE_IMAGE_FETCH_TIMEOUT", "5")),
    "LLMSERVE_MAX_IMAGE_BYTES": lambda: int(os.environ.get("LLMSERVE_MAX_IMAGE_BYTES", str(20 << 20))),
    "LLMSERVE_MAX_IMAGE_PIXELS": lambda: int(os.environ.get("LLMSERVE_MAX_IMAGE_PIXELS", str(40_000_000))),
    # where converted GGUF checkpoints and tokenizers are cached (default: $XDG_CACHE_HOME/llmserve, else
    # ~/.cache/llmserve)
    "LLMSERVE_CACHE_DIR": _cache_dir,
    # the API key `llmserve serve` requires when --api-key is not given (default: none, the API is open)
    "LLMSERVE_API_KEY": lambda: os.environ.get("LLMSERVE_API_KEY") or None,
    # seconds a tensor-parallel all-reduce may wait for a peer before the step fails (default 120)
    "LLMSERVE_TP_TIMEOUT": lambda: float(os.environ.get("LLMSERVE_TP_TIMEOUT", "120")),
    # "1": the server fails or kills its engine loop on marked prompts (a test facility, see
    # llmserve/server/faults.py; default off)
    "LLMSERVE_FAULT_INJECTION": lambda: os.environ.get("LLMSERVE_FAULT_INJECTION") == "1",
    # "1" / "true": `llmserve serve` offers POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters
    # loaded and dropped at runtime, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; default off). Read at start-up.
    "LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING": lambda: (
        os.environ.get("LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")
    ),
    # -- other tools' conventions, as llmserve reads them ----------------------------------------
    # OpenTelemetry's: where `llmserve serve` sends its request spans when --otlp-traces-endpoint is not given
    # (default: none, no tracing). The exporter's other OTEL_* variables (OTEL_BSP_SCHEDULE_DELAY, headers,
    # timeouts) are read by OpenTelemetry itself.
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": lambda: os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
    # any value: never download from the Hugging Face hub (a --model that is not a local path fails)
    "HF_HUB_OFFLINE": lambda: bool(os.environ.get("HF_HUB_OFFLINE")),
    # torchrun's (or by hand, for tensor parallelism over several machines): this process's rank, the
    # number of processes, the rank on this machine. RANK and WORLD_SIZE both set: started from outside.
    "RANK": lambda: _int_or_none("RANK"),
    "WORLD_SIZE": lambda: _int_or_none("WORLD_SIZE"),
    "LOCAL_RANK": lambda: int(os.environ.get("LOCAL_RANK", "0")),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
