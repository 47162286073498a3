"""A check with llama.cpp's own converter (not in CI: the tests must not depend on llama.cpp) of `--mmproj` pairs:
a tiny random Qwen2.5-VL / Qwen3-VL checkpoint (tests/vision_files.py's write_qwen_vl, 3 tower blocks: the converter
maps the merger's `mlp.2` only for 3 or more) is converted by llama.cpp's convert_hf_to_gguf.py, the text model
(--outtype f32) and the projector (--mmproj, --outtype f32, f16 and q8_0), and served by llmserve beside the folder:
the rendered chats and prompt ids (one image, two, none) must be equal, and the greedy tokens, batched and alone; the
first token's logprob difference is printed. The checkpoint takes llama.cpp's own image settings, which its converter
does not write: a 112-pixel attention window and 8..4096 merge units an image.

    PYTHONPATH=.:/work/.sp python -m benchmarks.peers.mmproj_llamacpp_convert
        [--llama-cpp ~/.cache/llmserve-peers/llama.cpp] [--keep DIR] [--only qwen2_5_vl,qwen3_vl]

(the converter runs with llama.cpp's gguf-py first on its PYTHONPATH: the installed gguf may be older)

Prints one line per family and projector type; exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

FAMILIES = {"qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}
PROJECTORS = ("f32", "f16", "q8_0")


def make_folder(folder: pathlib.Path, family: str) -> None:
    """The tiny checkpoint with llama.cpp's window (112 pixels) and image bounds (8..4096 units of 8x8 pixels)."""
    from llmserve.model.loader import bundled_model_path
    from tests.vision_files import write_qwen_vl

    write_qwen_vl(folder, bundled_model_path(), FAMILIES[family], depth=3)
    cfg = json.loads((folder / "config.json").read_text())
    if "window_size" in cfg["vision_config"]:
        cfg["vision_config"]["window_size"] = 112
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": 8 * 64, "longest_edge": 4096 * 64}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))


def convert(llama_cpp: str, folder: pathlib.Path, out: pathlib.Path, outtype: str, mmproj: bool) -> None:
    cmd = [sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype]
    cmd += ["--mmproj"] * mmproj + ["--outfile", str(out)]
    path = [os.path.join(llama_cpp, "gguf-py"), os.getenv("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def check(folder: pathlib.Path, text: pathlib.Path, projectors: dict) -> list[str]:
    from gguf import GGUFReader

    from llmserve import LLM, SamplingParams
    from tests.integration.test_vision_mmproj import ENGINE, GREEDY, _prompts

    ref = LLM(model=str(folder), **ENGINE)
    want_texts, want = _prompts(ref)
    expected = [o.outputs[0].token_ids for o in ref.generate(want, GREEDY, use_tqdm=False)]
    lp = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    ref_lp = [o.outputs[0].logprobs[0].logprob for o in ref.generate(want, lp, use_tqdm=False)]
    del ref
    lines = []
    for outtype, path in projectors.items():
        types = "/".join(sorted({t.tensor_type.name for t in GGUFReader(str(path)).tensors}))
        llm = LLM(model=str(text), mmproj=str(path), **ENGINE)
        texts, prompts = _prompts(llm)
        same = texts == want_texts and all(list(p) == list(q) for p, q in zip(prompts, want))
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in _prompts(llm)[1]]
        lps = [o.outputs[0].logprobs[0].logprob for o in llm.generate(prompts, lp, use_tqdm=False)]
        ok = same and batched == expected and alone == expected
        diff = max(abs(a - b) for a, b in zip(lps, ref_lp))
        lines.append(
            f"{'equal' if ok else 'DIFFERS'} mmproj {outtype} ({types}): prompts {'equal' if same else 'differ'}, "
            f"greedy batched {batched == expected}, alone {alone == expected}, max |d logprob| {diff:.1e}"
        )
        del llm
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", default=os.path.expanduser("~/.cache/llmserve-peers/llama.cpp"))
    p.add_argument("--keep", default=None, help="write the folders and files here (kept)")
    p.add_argument("--only", default=",".join(FAMILIES), help="families, comma-separated")
    a = p.parse_args()
    root = pathlib.Path(a.keep or tempfile.mkdtemp(prefix="mmproj-convert-"))
    failed = False
    for family in a.only.split(","):
        folder, files = root / family, root / f"{family}-gguf"  # (no tokenizer files beside the GGUFs)
        folder.mkdir(parents=True, exist_ok=True)
        files.mkdir(exist_ok=True)
        make_folder(folder, family)
        convert(a.llama_cpp, folder, files / "text-f32.gguf", "f32", False)
        projectors = {t: files / f"mmproj-{t}.gguf" for t in PROJECTORS}
        for outtype, path in projectors.items():
            convert(a.llama_cpp, folder, path, outtype, True)
        for line in check(folder, files / "text-f32.gguf", projectors):
            print(f"{family}: {line}", flush=True)
            failed |= not line.startswith("equal")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
