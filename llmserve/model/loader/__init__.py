"""Find and load model weights: GGUF files (the bundled default) and Hugging Face checkpoint folders.

Both are streamed: the model is built on the meta device, and each tensor is read from the file's memory
map under its Hugging Face name (GGUFTensors, SafetensorsWeights: mappings that read when asked), put into
its runtime format (a float parameter, an int8 / int4 layer, or a GGUF tensor's own blocks kept as they
are) and dropped. The model never knows where its weights came from.

By source: `lookup` (which file or folder), `gguf` (GGUF metadata -> a transformers config, its tensors under
Hugging Face names), `gguf_model` (a model straight from a GGUF file's blocks), `safetensors` (Hugging Face
folders), `build` (dtypes, the memory check, building and loading the model), `load` (the entry point).
Settings read at load time (gguf_model.WIDEN_GGUF_BYTES) live in their module, not here.
"""

from llmserve.model.loader.build import (
    activation_dtype,
    build_model,
    check_fits,
    checkpoint_names,
    resolve_dtype,
    resolve_kv_dtype,
)
from llmserve.model.loader.gguf import (
    GGUFTensors,
    gguf_arch,
    gguf_as_hf_folder,
    gguf_hf_config,
    gguf_hf_names,
    load_gguf_weights,
    open_gguf,
)
from llmserve.model.loader.gguf_model import (
    FLOAT_TYPES,
    Q4_TYPES,
    GGUFPackedBlocks,
    gguf_kept_blocks,
    gguf_served_bytes,
    load_gguf_model,
)
from llmserve.model.loader.load import load_model, load_model_config
from llmserve.model.loader.lookup import (
    BUNDLED_FILE,
    BUNDLED_NAME,
    BUNDLED_PACKAGE,
    ModelSource,
    bundled_model_path,
    resolve_model,
)
from llmserve.model.loader.request import LoadRequest
from llmserve.model.loader.safetensors import SafetensorsWeights, load_hf_model, load_hf_weights

__all__ = [
    "BUNDLED_FILE",
    "BUNDLED_NAME",
    "BUNDLED_PACKAGE",
    "FLOAT_TYPES",
    "Q4_TYPES",
    "GGUFPackedBlocks",
    "GGUFTensors",
    "LoadRequest",
    "ModelSource",
    "SafetensorsWeights",
    "activation_dtype",
    "build_model",
    "bundled_model_path",
    "check_fits",
    "checkpoint_names",
    "gguf_arch",
    "gguf_as_hf_folder",
    "gguf_hf_config",
    "gguf_hf_names",
    "gguf_kept_blocks",
    "gguf_served_bytes",
    "load_gguf_model",
    "load_gguf_weights",
    "load_hf_model",
    "load_hf_weights",
    "load_model",
    "load_model_config",
    "open_gguf",
    "resolve_dtype",
    "resolve_kv_dtype",
    "resolve_model",
]
