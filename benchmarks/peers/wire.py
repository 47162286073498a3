"""The wire: the raw HTTP responses (status, headers, transfer chunks, SSE events) of vLLM and llmserve to the
same requests, captured over a plain socket and diffed field by field (`python -m benchmarks.peers.clients wire`)."""

from __future__ import annotations

import json
import os
import socket
import time

from benchmarks.peers.servers import MODEL_NAME, Server

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Say hello in five words."}],
    "max_tokens": 6,
    "temperature": 0,
}
CMPL = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
USAGE = {"stream_options": {"include_usage": True}}
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 110
WIRE_CASES = {
    "chat": ("POST", "/v1/chat/completions", CHAT),
    "chat stream": ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    "chat stream include_usage": ("POST", "/v1/chat/completions", {**CHAT, "stream": True, **USAGE}),
    "chat stream continuous_usage_stats": (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ),
    "chat n=2": ("POST", "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1, "seed": 7}),
    "chat n=2 stream include_usage": (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "n": 2, "temperature": 1, "seed": 7, "stream": True, **USAGE},
    ),
    "chat logprobs": ("POST", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    "chat logprobs stream": (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": True},
    ),
    "completions": ("POST", "/v1/completions", CMPL),
    "completions stream": ("POST", "/v1/completions", {**CMPL, "stream": True}),
    "completions stream include_usage": ("POST", "/v1/completions", {**CMPL, "stream": True, **USAGE}),
    "completions n=2": ("POST", "/v1/completions", {**CMPL, "n": 2, "temperature": 1, "seed": 7}),
    "completions n=2 stream include_usage": (
        "POST",
        "/v1/completions",
        {**CMPL, "n": 2, "temperature": 1, "seed": 7, "stream": True, **USAGE},
    ),
    "completions logprobs": ("POST", "/v1/completions", {**CMPL, "logprobs": 2}),
    "completions logprobs stream": ("POST", "/v1/completions", {**CMPL, "logprobs": 2, "stream": True}),
    "completions echo": ("POST", "/v1/completions", {**CMPL, "echo": True, "max_tokens": 2}),
    # a long prompt makes the prefill visible: when does the first chunk come, when the first token?
    "chat stream, 1.5k-token prompt": (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "stream": True, "messages": [{"role": "user", "content": LONG + "Summarize."}]},
    ),
    "completions stream, 1.5k-token prompt": ("POST", "/v1/completions", {**CMPL, "stream": True, "prompt": LONG}),
    "error: unknown model (chat)": ("POST", "/v1/chat/completions", {**CHAT, "model": "no-such-model"}),
    "error: unknown model (completions, stream)": (
        "POST",
        "/v1/completions",
        {**CMPL, "model": "no-such-model", "stream": True},
    ),
    'error: bad field type (temperature: "hot")': ("POST", "/v1/chat/completions", {**CHAT, "temperature": "hot"}),
    "error: out of range (max_tokens: 0)": ("POST", "/v1/completions", {**CMPL, "max_tokens": 0}),
    "error: messages missing": ("POST", "/v1/chat/completions", {"model": MODEL_NAME}),
    "error: max_tokens beyond the context": ("POST", "/v1/completions", {**CMPL, "max_tokens": 1000000}),
    "error: body not JSON": ("POST", "/v1/chat/completions", b"{not json"),
    "models": ("GET", "/v1/models", None),
    "error: no such route": ("GET", "/v1/nope", None),
}


def raw_exchange(port: int, method: str, path: str, body, timeout: float = 300) -> dict:
    """One HTTP/1.1 request over a plain socket; the response as sent: status, headers in order, the body's
    transfer chunks (one per server write) with their arrival times (s after the request was sent), and each
    network read's size and time."""
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: llmserve-wire/1\r\n"
        "Accept: */*\r\nConnection: close\r\n"
    )
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    reads, times = [], []
    with socket.create_connection(("127.0.0.1", port), timeout) as s:
        t0 = time.perf_counter()
        s.sendall(head.encode() + b"\r\n" + data)
        while chunk := s.recv(65536):
            reads.append(chunk)
            times.append(round(time.perf_counter() - t0, 4))
    raw = b"".join(reads)
    ends = [sum(len(r) for r in reads[: i + 1]) for i in range(len(reads))]  # byte offset after each read

    def arrival(offset: int) -> float:  # when the byte at `offset` had arrived
        return next(t for e, t in zip(ends, times) if e > offset)

    head_b, _, rest = raw.partition(b"\r\n\r\n")
    pos = len(head_b) + 4
    lines = head_b.decode("latin-1").split("\r\n")
    headers = [tuple(x.strip() for x in ln.split(":", 1)) for ln in lines[1:]]
    chunks, chunk_times = [], []
    if any(k.lower() == "transfer-encoding" and "chunked" in v.lower() for k, v in headers):
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            pos += len(size_line) + 2
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            chunks.append(rest[:size].decode("utf-8", "replace"))
            chunk_times.append(arrival(pos + size - 1))
            rest, pos = rest[size + 2 :], pos + size + 2
        text = "".join(chunks)
    else:
        text = rest.decode("utf-8", "replace")
    return dict(
        status=lines[0],
        headers=headers,
        body=text,
        chunks=chunks,
        chunk_times=chunk_times,
        reads=[len(r) for r in reads],
        read_times=times,
    )


def flatten(obj, prefix: str = "") -> dict[str, str]:
    """{"choices[].delta.content": "str", ...}: every leaf's path and JSON type (lists as [])."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        if not obj:
            out[prefix or "."] = "{}"
        for k, v in obj.items():
            if prefix.endswith("top_logprobs[]") and not isinstance(v, (dict, list)):
                k = "<token>"  # completions' logprobs: {token: logprob} maps
            out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(obj, list):
        if not obj:
            out[prefix + "[]"] = "[] (empty)"
        for v in obj:
            for k, t in flatten(v, prefix + "[]").items():
                out[k] = t if out.get(k, t) == t else "|".join(sorted({*out[k].split("|"), t}))
    else:
        out[prefix] = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str"}[type(obj)]
    return out


KEEP_VALUES = ("object", "finish_reason", "stop_reason", "role", "type", "code", "param", "owned_by")


def event_kind(d: dict) -> str:
    """A streamed chunk's role in the stream, for lining the two servers' streams up."""
    ch = d.get("choices")
    if "error" in d:
        return "error"
    if not ch:
        return "usage" if d.get("usage") else "empty"
    c = ch[0]
    if c.get("finish_reason"):
        return "finish"
    delta = c.get("delta", c)
    if delta.get("role"):
        return "role"
    return "content" if (delta.get("content") or c.get("text")) else "empty-delta"


def describe(resp: dict) -> dict:
    """The comparable shape of one response: status, headers, JSON fields (or per event kind for SSE)."""
    hdr = {k.lower(): v for k, v in resp["headers"]}
    desc = dict(
        status=resp["status"].split(" ", 1)[1] if " " in resp["status"] else resp["status"],
        headers={
            k: (
                v
                if k
                in ("content-type", "transfer-encoding", "cache-control", "connection", "x-accel-buffering", "server")
                else "(present)"
            )
            for k, v in hdr.items()
            if k not in ("date", "content-length")
        },
        fields={},
        values={},
    )
    body = resp["body"]
    if hdr.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in body.split("\n\n") if e]
        kinds, other = [], []
        for e in events:
            for line in e.split("\n"):
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    d = json.loads(line[6:])
                    k = event_kind(d)
                    kinds.append(k)
                    for p, t in flatten(d).items():
                        desc["fields"][f"<{k}> {p}"] = t
                        if p.split(".")[-1].rstrip("[]") in KEEP_VALUES:
                            desc["values"].setdefault(f"<{k}> {p}", set()).add(json.dumps(d_get(d, p)))
                elif line == "data: [DONE]":
                    kinds.append("[DONE]")
                else:
                    other.append(line[:40])
        desc["events"] = compress(kinds)
        firsts: dict[str, float] = {}
        for chunk, t in zip(resp.get("chunks", []), resp.get("chunk_times", [])):
            for line in chunk.split("\n"):
                if line.startswith("data: {"):
                    firsts.setdefault(event_kind(json.loads(line[6:])), t)
        desc["first chunk at"] = f"{min(firsts.values()):.2f} s" if firsts else None
        desc["first content at"] = f"{firsts['content']:.2f} s" if "content" in firsts else None
        desc["non-data lines"] = sorted(set(other))
        desc["events split across writes"] = sum(1 for c in resp["chunks"] if not c.endswith("\n\n"))
        desc["writes"] = len(resp["chunks"])
    else:
        try:
            d = json.loads(body)
        except ValueError:
            desc["fields"]["(body)"] = f"not JSON: {body[:80]!r}"
            return desc
        for p, t in flatten(d).items():
            desc["fields"][p] = t
            if p.split(".")[-1].rstrip("[]") in KEEP_VALUES:
                desc["values"].setdefault(p, set()).add(json.dumps(d_get(d, p)))
    desc["values"] = {k: sorted(v) for k, v in desc["values"].items()}
    return desc


def d_get(d, path: str):
    """The values at a flattened path (lists expanded): one value, or the list of them."""
    vals = [d]
    for part in path.split("."):
        name, lists = part.rstrip("[]"), (len(part) - len(part.rstrip("[]"))) // 2
        vals = [v.get(name) if isinstance(v, dict) else None for v in vals]
        for _ in range(lists):
            vals = [x for v in vals if isinstance(v, list) for x in v]
    return vals[0] if len(vals) == 1 else vals


def compress(kinds: list[str]) -> str:
    out: list[list] = []
    for k in kinds:
        if out and out[-1][0] == k:
            out[-1][1] += 1
        else:
            out.append([k, 1])
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in out)


def diff(a: dict, b: dict, names=("vllm", "llmserve")) -> list[str]:
    """Field-by-field differences of two describe() results, as lines."""
    out = []
    for key in ("status", "events", "non-data lines", "events split across writes"):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {names[0]} {a.get(key)!r} / {names[1]} {b.get(key)!r}")
    for part in ("headers", "fields", "values"):
        x, y = a[part], b[part]
        for k in sorted(set(x) | set(y)):
            if k not in y:
                out.append(f"{part}: only {names[0]}: {k} = {x[k]}")
            elif k not in x:
                out.append(f"{part}: only {names[1]}: {k} = {y[k]}")
            elif x[k] != y[k]:
                out.append(f"{part}: {k}: {names[0]} {x[k]} / {names[1]} {y[k]}")
    return out


def capture(port: int, out: str, kind: str) -> dict:
    res = {}
    for name, (method, path, body) in WIRE_CASES.items():
        res[name] = raw_exchange(port, method, path, body)
    json.dump(res, open(os.path.join(out, f"wire-{kind}.json"), "w"), indent=1)
    return res


def wire(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    caps = {}
    for kind in ("vllm", "llmserve"):
        path = os.path.join(a.out, f"wire-{kind}.json")
        if a.reuse and os.path.exists(path):
            caps[kind] = json.load(open(path))
            continue
        if a.only and a.only != kind:
            continue
        with Server(kind, a.port, a.out, a.attach) as server:
            caps[kind] = capture(server.port, a.out, kind)
    if a.only:
        return
    lines = []
    for name in WIRE_CASES:
        dv, dl = describe(caps["vllm"][name]), describe(caps["llmserve"][name])
        lines.append(f"### {name}\n")
        for who, dd in (("vllm", dv), ("llmserve", dl)):
            lines.append(
                f"- {who}: {dd['status']}"
                + (
                    f", events: {dd['events']}; first chunk at {dd['first chunk at']}, first content at "
                    f"{dd['first content at']}"
                    if "events" in dd
                    else ""
                )
            )
        lines += [f"  - {x}" for x in diff(dv, dl)] or ["  - (no difference)"]
        lines.append("")
    path = os.path.join(a.out, "wire-diff.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"written: {path}")
