"""Memory and time to load a model, per weight mode: each load in a child process of its own, whose peak resident
memory the kernel reports (getrusage of the waited child, so every transient of the load counts), its resident
memory once loaded and after a short generation, and the load time; beside them the runtime's own (a process that
imports llmserve and builds the kernels, no model) and the file's size, so the issue's bound reads off the table:
peak <= 1.5 x the file + the KV budget + the runtime.

    python -m benchmarks.engine.load_memory --model ~/ckpt/llama-1b/model-Q8_0.gguf --modes none,int8 [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import ROOT, write_section


def child(args) -> None:
    import psutil

    from llmserve import LLM, SamplingParams

    if args.child == "runtime":
        from llmserve.model.kernels.ops import cpu_kernels

        cpu_kernels()
        print("RESULT " + json.dumps({}), flush=True)
        return
    t = time.perf_counter()
    llm = LLM(
        args.model,
        quantization=None if args.child == "none" else args.child,
        kv_cache_memory=args.kv_gib,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
    )
    load = time.perf_counter() - t
    loaded = psutil.Process().memory_info().rss
    llm.generate([[100, 200, 300]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    after = psutil.Process().memory_info().rss
    print("RESULT " + json.dumps(dict(load_s=load, loaded=loaded, after=after)), flush=True)


def measure(args, mode: str) -> dict:
    cmd = [sys.executable, "-m", __spec__.name, "--child", mode, "--kv-gib", str(args.kv_gib)]
    cmd += ["--max-model-len", str(args.max_model_len), "--threads", str(args.threads)]
    cmd += ["--model", args.model] if args.model else []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, so its own rusage: the peak of this load alone
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{mode}: failed\n{err.read()[-3000:]}")
    res = json.loads(line[7:])
    res["peak"] = usage.ru_maxrss * 1024
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face folder or GGUF file (default: the bundled model)")
    p.add_argument("--modes", default="none,int8", help="--quantization values (none: the model's dtype)")
    p.add_argument("--kv-gib", type=float, default=0.25)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.child:
        return child(args)
    gib = 2**30
    runtime = measure(args, "runtime")["peak"]
    size = os.path.getsize(args.model) if args.model and os.path.isfile(args.model) else None
    rows = [
        "| mode | load s | peak RSS GiB | loaded GiB | after a generation GiB | bound GiB: 1.5 x file + KV + runtime |",
        "|---|---|---|---|---|---|",
    ]
    for mode in args.modes.split(","):
        r = measure(args, mode)
        bound = f"{(1.5 * size + args.kv_gib * gib + runtime) / gib:.2f}" if size else "-"
        rows.append(
            f"| {mode} | {r['load_s']:.1f} | {r['peak'] / gib:.2f} | {r['loaded'] / gib:.2f} | "
            f"{r['after'] / gib:.2f} | {bound} |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    if not args.no_write:
        model = os.path.basename(str(args.model or "bundled SmolLM2-135M-Instruct").rstrip("/"))
        body = (
            f"`python -m benchmarks.engine.load_memory {' '.join(sys.argv[1:])}`: file "
            + (f"{size / gib:.2f} GiB" if size else "a folder")
            + f", KV budget {args.kv_gib} GiB, runtime (llmserve imported, kernels built, no model) "
            f"{runtime / gib:.2f} GiB peak; each load in its own process (peak: its maxrss).\n\n{table}\n"
        )
        write_section(f"Load memory: {model}", body)


if __name__ == "__main__":
    main()
