"""ServerState.unload (what `--models-dir` does to an idle model): the engine stops, nothing keeps it alive (the
LLMEngine is collected: its weights and KV cache are freed) and load / unload cycles do not leak resident memory;
the metrics object outlives the engine, so a model's counters go on after a reload."""

from __future__ import annotations

import gc
import weakref

import psutil

from llmserve.config import EngineConfig
from llmserve.serve_config import ServerSettings
from llmserve.server.state import ServerState
from tests.checkpoints import tiny_llama


def _tiny(path: str, bundled_gguf: str) -> str:
    tiny_llama(
        path,
        bundled_gguf,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return path


def test_unload_frees_the_engine_and_cycles_do_not_leak(tmp_path, bundled_gguf):
    folder = _tiny(str(tmp_path / "m"), bundled_gguf)
    st = ServerState(ServerSettings(engine=EngineConfig(model=folder, kv_cache_memory=0.1, num_threads=1)))
    proc = psutil.Process()
    after = []
    metrics = None
    for _ in range(3):
        st.load()
        assert st.load_error is None and st.ready
        metrics = metrics or st.metrics
        assert st.metrics is metrics  # kept across loads
        ref = weakref.ref(st.engine.engine)
        loaded = proc.memory_info().rss
        st.unload()
        gc.collect()
        assert st.engine is None and not st.ready
        assert ref() is None, [type(r) for r in gc.get_referrers(ref())]
        after.append(proc.memory_info().rss)
        assert after[-1] < loaded - 100 * 2**20  # the KV cache (0.1 GiB) and the weights went back
    assert after[2] - after[0] < 64 * 2**20, after
