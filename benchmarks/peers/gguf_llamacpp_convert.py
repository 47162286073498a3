"""A check with llama.cpp's own converter (not in CI: the tests must not depend on llama.cpp): for each GGUF
architecture llmserve reads beyond llama / qwen2 / qwen3, a tiny random transformers checkpoint with the
bundled tokenizer is converted by llama.cpp's convert_hf_to_gguf.py (--outtype f32 and q8_0) and served;
llmserve's greedy tokens, batched and alone, must equal transformers' on the checkpoint (for q8_0: with the
file's Q8_0 values, gguf's own quantize / dequantize, the algorithm llama.cpp's converter runs). gpt-oss also from
an MXFP4 folder as OpenAI ships it (the converter keeps the experts' blocks): against transformers on the experts
dequantized by transformers' MXFP4 code.

    python -m benchmarks.peers.gguf_llamacpp_convert [--llama-cpp ~/.cache/llmserve-peers/llama.cpp] [--keep DIR]
        [--only a,b]

Prints one line per architecture and type; exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

from tests.integration.test_architectures import GRANITE, _longrope, mxfp4_folders
from tests.integration.test_architectures import SMALL as TINY  # the bundled 49,152-token vocabulary
from tests.integration.test_gguf_architectures import GRANITE_HYBRID

# llama.cpp's converter, run as it is but for one thing: Gemma 2's and Phi-3's converters read a SentencePiece
# tokenizer.model, and GLM-4's looks up GLM's special tokens, which these checkpoints (the bundled BPE tokenizer)
# lack: they take the BPE path the others take (the tokenizer is not what is checked)
CONVERT = """
import sys
root = sys.argv.pop(1)  # also on PYTHONPATH (main passes it): convert_hf_to_gguf is imported from there
sys.argv[0] = root + "/convert_hf_to_gguf.py"
import convert_hf_to_gguf
from conversion.base import TextModel
from conversion.gemma import Gemma2Model
from conversion.glm import Glm4Model
from conversion.phi import Phi3MiniModel
Gemma2Model.set_vocab = Phi3MiniModel.set_vocab = Glm4Model.set_vocab = TextModel._set_vocab_gpt2
convert_hf_to_gguf.main()
"""
# Qwen3-MoE with norm_topk_prob: llama.cpp renormalises Qwen3-MoE's top-k weights always (the converter
# writes no flag), as the released models do
GEMMA = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=24)
# gpt-oss: a sliding and a full layer, the window shorter than the longer prompts
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24)
LONGROPE = _longrope(4, 6)  # (three quarters of each 16-wide head rotated: 6 pairs, the converter checks)


def cases():
    import transformers as T

    return {
        "gemma2": (T.Gemma2Config, GEMMA),
        "gemma3": (T.Gemma3TextConfig, dict(GEMMA, num_hidden_layers=6)),
        "phi3": (T.Phi3Config, {}),
        "qwen3moe": (
            T.Qwen3MoeConfig,
            dict(num_experts=4, moe_intermediate_size=64, head_dim=16, num_experts_per_tok=2, norm_topk_prob=True),
        ),
        "mixtral": (T.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
        "phi4-mini": (
            T.Phi3Config,
            dict(partial_rotary_factor=0.75, original_max_position_embeddings=4, rope_scaling=LONGROPE),
        ),
        "granite": (T.GraniteConfig, dict(GRANITE)),
        "smollm3": (T.SmolLM3Config, dict(num_hidden_layers=4)),  # (llama.cpp: no rotary on every 4th layer)
        "olmo2": (T.Olmo2Config, dict(tie_word_embeddings=False)),
        "glm4": (T.Glm4Config, dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True)),
        "granite-bias": (T.GraniteConfig, dict(GRANITE, attention_bias=True)),  # (Q / K biases interleaved too)
        "olmo2-bias": (T.Olmo2Config, dict(tie_word_embeddings=False, attention_bias=True)),
        # gpt-oss with float experts (the converter splits and transposes them), and as OpenAI ships it: MXFP4 experts
        # (the converter repacks their blocks as they are; the rest f32 or q8_0)
        "gpt-oss": (T.GptOssConfig, GPT_OSS),
        "gpt-oss-mxfp4": (T.GptOssConfig, GPT_OSS),
        # LFM2: short-convolution layers around an attention layer (shortconv.* tensors, head_count_kv per layer)
        "lfm2": (T.Lfm2Config, dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])),
        # Granite 4.0-H: Mamba-2 mixers (two groups) around an attention layer without positions, experts beside the
        # shared MLP, the multipliers (ssm_* tensors, A as -exp(A_log), head_count_kv per layer)
        "granite-hybrid": (
            T.GraniteMoeHybridConfig,
            dict(GRANITE_HYBRID, layer_types=["mamba", "attention", "mamba"]),  # (a mixer first)
        ),
    }


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist() for n in (5, 49, 21)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", default=os.path.expanduser("~/.cache/llmserve-peers/llama.cpp"))
    ap.add_argument("--keep", default=None, help="write the checkpoints and files here (default: a temp dir)")
    ap.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    args = ap.parse_args()
    import transformers

    from llmserve import LLM
    from llmserve.model.formats.gguf_layers import GGUFLinear
    from llmserve.model.loader import bundled_model_path, gguf_model
    from llmserve.tokenizer import Tokenizer
    from tests.gguf_files import round_trip_model
    from tests.integration.test_architectures import greedy_batched_and_alone

    root = args.keep or tempfile.mkdtemp(prefix="gguf-llamacpp-")
    tok = Tokenizer(bundled_model_path(), gguf=True).hf
    failed, widen = 0, gguf_model.WIDEN_GGUF_BYTES
    for name, (cls, extra) in cases().items():
        if args.only and name not in args.only.split(","):
            continue
        folder = os.path.join(root, name)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cls(**{**TINY, **extra}))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0.0 if "Gemma" in cls.__name__ else 1.0, 0.3)
                elif n.endswith(("bias", ".sinks")):  # (away from transformers' zeros; gpt-oss's experts' `_bias`)
                    p.normal_(0.0, 0.3)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        if name == "granite-hybrid":  # the hub's layer_types names, which the converter reads (not transformers')
            import json

            config = json.load(open(os.path.join(folder, "config.json")))
            config["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in config["layer_types"]]
            json.dump(config, open(os.path.join(folder, "config.json"), "w"))
        source = reference = folder
        if name.endswith("-mxfp4"):  # converted from the MXFP4 folder, checked against its experts dequantized
            folders = mxfp4_folders(pathlib.Path(folder), pathlib.Path(root) / f"{name}-folders")
            source, reference = str(folders["mxfp4"]), str(folders["dense"])
        for outtype in ("f32", "q8_0"):
            path = os.path.join(root, f"{name}-{outtype}.gguf")
            run = subprocess.run(
                [sys.executable, "-c", CONVERT, args.llama_cpp, source, "--outtype", outtype, "--outfile", path],
                capture_output=True,
                text=True,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, [args.llama_cpp, os.getenv("PYTHONPATH")])),
                },
            )
            if run.returncode:
                print(f"{name} {outtype}: llama.cpp's converter failed: {run.stderr.strip().splitlines()[-1:]}")
                failed += 1
                continue
            ref = transformers.AutoModelForCausalLM.from_pretrained(
                reference, dtype=torch.float32, attn_implementation="eager"
            )
            # (MXFP4 experts: their values round-trip exactly, the rest as the converter's q8_0 rounds it)
            round_trip_model(ref, "F32" if outtype == "f32" else "MXFP4" if source != folder else "Q8_0")
            with torch.inference_mode():
                want = [
                    ref.generate(
                        torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
                    )[0, len(p) :].tolist()
                    for p in prompts()
                ]
            # q8_0: the file's blocks kept (GGUFLinear, experts over their rows), as a big model gets them
            gguf_model.WIDEN_GGUF_BYTES = 0 if outtype == "q8_0" else widen
            llm = LLM(model=path, kv_cache_memory=0.05, max_num_batched_tokens=32)
            batched, alone = greedy_batched_and_alone(llm, prompts(), 12)
            ok = batched == want and alone == want
            failed += not ok
            arch = llm.engine.model_config.architecture
            kept = sum(isinstance(m, GGUFLinear) for m in llm.engine.model.modules())
            print(
                f"{name} {outtype}: {arch} {'equal' if ok else 'DIFFERENT'} (batched and alone, {len(want)} prompts; "
                f"{kept} layers kept as the file's blocks)"
            )
            del llm
    print(f"files in {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
