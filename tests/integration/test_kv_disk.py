"""The disk tier of the prefix cache (--kv-cache-dir): a fresh engine on the same folder loads the blocks an
earlier one computed and answers the same greedy tokens as transformers; another model's files, corrupt
files and a folder that cannot be written never change an answer."""

from __future__ import annotations

import logging
import os
import resource
import signal

import pytest
import torch

from tests.checkpoints import tiny_llama

MAX_TOKENS = 8
BS = 16


def _checkpoint(path, seed, bundled_gguf):
    return tiny_llama(
        path,
        bundled_gguf,
        seed=seed,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        initializer_range=0.2,
    )


def _hf_greedy(model, ids):
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bundled_gguf):
    root = tmp_path_factory.mktemp("kvdisk")
    a = _checkpoint(root / "a", 0, bundled_gguf)
    b = _checkpoint(root / "b", 1, bundled_gguf)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (150, 97)]
    return {
        "a": str(root / "a"),
        "b": str(root / "b"),
        "prompts": prompts,
        "refs_a": [_hf_greedy(a, p) for p in prompts],
        "refs_b": [_hf_greedy(b, p) for p in prompts],
    }


def _llm(model, folder, **kw):
    from llmserve import LLM

    return LLM(model=model, kv_cache_dir=str(folder), kv_cache_memory=0.05, max_num_batched_tokens=64, **kw)


def _gen(llm, prompts):
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if llm.engine.kv.disk is not None:
        llm.engine.kv.disk.flush()
    return [o.outputs[0].token_ids for o in outs]


def _disk(llm) -> dict:
    return llm.engine.stats().kv_disk


def _files(folder) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(folder) for n in names if n.endswith(".kv"))


def test_a_fresh_engine_loads_the_blocks_and_answers_the_same(setup, tmp_path):
    first = _llm(setup["a"], tmp_path)
    assert _gen(first, setup["prompts"][:1]) == setup["refs_a"][:1]
    written = _disk(first)["kv_disk_bytes_written"]
    assert _disk(first)["external_prefix_cache_hits"] == 0
    assert len(_files(tmp_path)) == 150 // BS and written > 0
    first.engine.shutdown()
    del first

    second = _llm(setup["a"], tmp_path)  # a restart: nothing in RAM
    assert _gen(second, setup["prompts"]) == setup["refs_a"]  # batched with a prompt it never saw
    d = _disk(second)
    assert d["external_prefix_cache_hits"] == (150 - 1) // BS * BS
    assert d["kv_disk_bytes_read"] >= written and d["kv_disk_corrupt_files"] == 0
    assert d["kv_disk_load_seconds"] > 0
    assert len(_files(tmp_path)) == 150 // BS + 97 // BS  # the new prompt's blocks written too
    second.engine.shutdown()


def test_files_of_another_model_are_ignored(setup, tmp_path):
    a = _llm(setup["a"], tmp_path)
    _gen(a, setup["prompts"][:1])
    a.engine.shutdown()
    a_files = _files(tmp_path)
    b = _llm(setup["b"], tmp_path)
    assert b.engine.kv.disk.dir != a.engine.kv.disk.dir
    # even a's files copied under b's folder, with the names b looks up, are not trusted
    for p in a_files:
        dst = os.path.join(b.engine.kv.disk.dir, os.path.relpath(p, a.engine.kv.disk.dir))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(p, "rb") as src, open(dst, "wb") as out:
            out.write(src.read())
    assert _gen(b, setup["prompts"][:1]) == setup["refs_b"][:1]
    d = _disk(b)
    assert d["external_prefix_cache_hits"] == 0 and d["kv_disk_corrupt_files"] == 1  # the first one looked up
    b.engine.shutdown()


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "flip a header byte"])
def test_a_corrupt_file_is_recomputed(setup, tmp_path, damage):
    first = _llm(setup["a"], tmp_path)
    _gen(first, setup["prompts"][:1])
    first.engine.shutdown()
    files = {os.path.basename(p): p for p in _files(tmp_path)}
    # the third block of the prompt: blocks 0-1 load, block 2 and the rest are recomputed
    from llmserve.engine.kv_events import chain_digests

    third = files[chain_digests(setup["prompts"][0], BS)[2].hex() + ".kv"]
    data = bytearray(open(third, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-100 if "payload" in damage else 60] ^= 0x40
    open(third, "wb").write(bytes(data))

    second = _llm(setup["a"], tmp_path)
    assert _gen(second, setup["prompts"][:1]) == setup["refs_a"][:1]
    d = _disk(second)
    assert d["kv_disk_corrupt_files"] == 1 and d["external_prefix_cache_hits"] == 2 * BS
    second.engine.shutdown()
    assert open(third, "rb").read() != bytes(data)  # written again, whole
    third_run = _llm(setup["a"], tmp_path)
    assert _gen(third_run, setup["prompts"][:1]) == setup["refs_a"][:1]
    assert _disk(third_run)["external_prefix_cache_hits"] == (150 - 1) // BS * BS
    third_run.engine.shutdown()


def test_an_unwritable_folder_turns_the_tier_off(setup, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="llmserve.kv_disk"):
        llm = _llm(setup["a"], blocker / "kv")
    assert llm.engine.kv.disk is None
    assert _gen(llm, setup["prompts"][:1]) == setup["refs_a"][:1]
    assert len([r for r in caplog.records if "kv disk" in r.message]) == 1
    assert llm.engine.stats().kv_disk is None


def test_a_full_folder_turns_the_tier_off_and_serving_goes_on(setup, tmp_path, caplog):
    llm = _llm(setup["a"], tmp_path)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # the file system takes no file over 4 KiB: each block's write fails (EFBIG), as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
    try:
        with caplog.at_level(logging.WARNING, logger="llmserve.kv_disk"):
            assert _gen(llm, setup["prompts"]) == setup["refs_a"]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert not llm.engine.kv.disk.enabled
    assert len([r for r in caplog.records if "disk tier is off" in r.message]) == 1
    assert _files(tmp_path) == [] and not [n for _, _, ns in os.walk(tmp_path) for n in ns if n.endswith(".tmp")]
    assert _gen(llm, setup["prompts"]) == setup["refs_a"]  # and again, from RAM
    llm.engine.shutdown()


def test_the_folder_keeps_under_its_size(setup, tmp_path):
    one = 3 * 2 * BS * 64 * 4 + 96  # a block of this model: 3 layers, K and V, 16 tokens, 1 head of 64, float32
    llm = _llm(setup["a"], tmp_path, kv_cache_dir_size=6 * one / (1 << 30))
    _gen(llm, setup["prompts"])
    sizes = [os.path.getsize(p) for p in _files(tmp_path)]
    assert sizes and sum(sizes) <= 6 * one
    llm.engine.shutdown()
