"""The Mamba-2 mixer's prefill scan (llmserve.model.layers.mamba2): the chunked form (`ssd_scan`, a few matmuls per
chunk) against the plain per-token recurrence (`ssd_step` once per token, what decode runs), on one mixer of a
Granite-4.0-H-shaped layer (48 heads of 64, state 128, one group), for prompt chunks of --lengths tokens, best of
--repeats; and the whole mixer (in_proj, convolution, scan, gated norm, out_proj) over the same chunks.

    python -m benchmarks.kernels.mamba2_scan [--threads 2] [--lengths 64,512] [--chunk 256] [--no-write]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import write_section


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def per_token(x, dt, A, B, C, state):
    """The recurrence one token at a time (ssd_step on a batch of one)."""
    from llmserve.model.layers.mamba2 import ssd_step

    ys, state = [], state.unsqueeze(0)
    for t in range(x.shape[0]):
        y, state = ssd_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], state)
        ys.append(y)
    return torch.cat(ys), state[0]


def measure(mixer, n: int, chunk: int, repeats: int) -> str:
    """One table row: the scans over n tokens (checked equal first), and the whole mixer's prefill."""
    from llmserve.model.layers.mamba2 import ssd_scan

    m = mixer.m
    x = torch.randn(n, m.heads, m.head_dim)
    dt = torch.rand(n, m.heads) * 0.1
    A = -torch.arange(1, m.heads + 1, dtype=torch.float32)
    B, C = torch.randn(n, m.heads, m.state), torch.randn(n, m.heads, m.state)
    s0 = torch.randn(m.heads, m.head_dim, m.state)
    y1, f1 = ssd_scan(x, dt, A, B, C, s0, chunk)
    y2, f2 = per_token(x, dt, A, B, C, s0)
    assert torch.allclose(y1, y2, atol=1e-3, rtol=1e-3) and torch.allclose(f1, f2, atol=1e-3, rtol=1e-3)
    chunked = best(lambda: ssd_scan(x, dt, A, B, C, s0, chunk), repeats)
    token = best(lambda: per_token(x, dt, A, B, C, s0), repeats)
    h = torch.randn(n, mixer.in_proj.in_features)
    conv, ssm = (torch.zeros(s) for s in mixer.state_shapes())
    whole = best(lambda: mixer.prefill(h, conv, ssm), repeats)
    return f"| {n} | {chunked * 1e3:.1f} | {token * 1e3:.1f} | {token / chunked:.1f}x | {whole * 1e3:.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="64,512")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from llmserve.model.config import MambaConfig
    from llmserve.model.layers.mamba2 import Mamba2Mixer

    m = MambaConfig(heads=48, head_dim=64, groups=1, state=128, conv_kernel=4, chunk_size=a.chunk)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(1536, m, 1e-5).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.05)
        mixer.A_log.copy_(torch.log(torch.arange(1, m.heads + 1, dtype=torch.float32)))
    rows = [
        "| tokens | chunked scan (ms) | per-token recurrence (ms) | ratio | whole mixer, chunked (ms) |",
        "|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        rows += [measure(mixer, int(n), a.chunk, a.repeats) for n in a.lengths.split(",")]
    body = (
        f"One Mamba-2 mixer of Granite 4.0-H's shape (hidden 1536, 48 heads of 64, state 128), float32, "
        f"{a.threads} threads, scan chunk {a.chunk}, best of {a.repeats} "
        "(`python -m benchmarks.kernels.mamba2_scan`):\n\n" + "\n".join(rows)
    )
    print(body)
    if not a.no_write:
        write_section("Mamba-2 prefill scan: chunked against per-token", body)


if __name__ == "__main__":
    main()
