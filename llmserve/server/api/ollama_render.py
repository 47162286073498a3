"""Ollama's answers (api/ollama.py's rendering): /api/chat and /api/generate as one JSON object or NDJSON
lines (a line per piece of text, then the `done` line with `done_reason` and the counts and durations,
in nanoseconds, as Ollama reports them), /api/embed's and /api/embeddings' vectors, and the model
descriptions /api/tags, /api/show and /api/ps list (details, model_info, size, digest)."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone

from llmserve.engine.request import RequestOutput
from llmserve.server.api.chat import chat_logprobs
from llmserve.server.errors import APIError
from llmserve.server.rendering import ChoiceText, Rendering

NDJSON = "application/x-ndjson"
NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at of a model that is never unloaded


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return max(0, int((seconds or 0.0) * 1e9))


def _line(d: dict) -> str:
    return json.dumps(d, ensure_ascii=False) + "\n"


def ollama_tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's tool calls (arguments a JSON string) in Ollama's shape (arguments an object)."""
    out = []
    for c in calls:
        f = c["function"]
        try:
            args = json.loads(f["arguments"])
        except (TypeError, json.JSONDecodeError):
            args = {}
        out.append({"function": {"name": f["name"], "arguments": args}})
    return out


class OllamaRendering(Rendering):
    """/api/chat (`message`) or /api/generate (`response`, `thinking`, `context`): one choice. With
    `logprobs` asked for (`tokenizer` given), each answer's `logprobs`: per token its text, logprob, bytes
    and `top_logprobs`; streamed, a line carries the tokens that came since the last line (text held back
    for a tool call or a reasoning marker: its tokens go with the next line sent)."""

    media_type = NDJSON

    def __init__(
        self, kind: str, model: str, reasoning=None, tool_plan=None, think: bool = True, tokenizer=None, load=0.0
    ) -> None:
        self.kind, self.model = kind, model
        self.load = load  # seconds this request waited for its model to load (--models-dir)
        self.reasoning, self.tool_plan, self.think = reasoning, tool_plan, think
        self.tok = tokenizer
        self.text: ChoiceText | None = None
        self.pending: list = []  # streamed tokens' logprobs not yet sent

    def _logprobs(self, lps) -> list | None:
        return None if lps is None else chat_logprobs(self.tok, lps)["content"]

    def _head(self) -> dict:
        return {"model": self.model, "created_at": now_rfc3339()}

    def _piece(self, content: str, thinking: str = "", calls: list | None = None) -> dict:
        d = self._head()
        if self.kind == "chat":
            msg = {"role": "assistant", "content": content}
            if thinking and self.think:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = ollama_tool_calls(calls)
            d["message"] = msg
        else:
            d["response"] = content
            if thinking and self.think:
                d["thinking"] = thinking
        d["done"] = False
        return d

    def _done(self, gen, out: RequestOutput, d: dict) -> dict:
        c = out.outputs[0]
        prompt, completion, _ = gen.counts()
        m = out.metrics
        start = (m.first_scheduled_time or m.arrival_time) if m else gen.arrival
        first = (m.first_token_time if m else None) or start
        end = (m.finished_time if m else None) or first
        d.update(
            done=True,
            done_reason="length" if c.finish_reason == "length" else "stop",
            total_duration=_ns(max(end, first) - gen.arrival + self.load),
            load_duration=_ns(self.load),
            prompt_eval_count=prompt,
            prompt_eval_duration=_ns(first - start),
            eval_count=completion,
            eval_duration=_ns(end - first),
        )
        if self.kind == "generate":
            d["context"] = list(gen.runs[0][2]) + list(c.token_ids)
        return d

    def body(self, gen) -> dict:
        out = gen.finals[0]
        text = ChoiceText.whole(out.outputs[0].text, self.reasoning, self.tool_plan)
        content, calls = text.calls()
        d = self._piece(content or "", text.reasoning, calls)
        if self.tok is not None and out.outputs[0].logprobs is not None:
            d["logprobs"] = self._logprobs(out.outputs[0].logprobs)
        return self._done(gen, out, d)

    def stream_output(self, gen, i: int, out: RequestOutput) -> list[str]:
        if self.text is None:
            self.text = ChoiceText(self.reasoning, self.tool_plan)
        reasoning, pieces = self.text.feed(out.outputs[0].delta_text, out.finished)
        content = "".join(d.content for d in pieces)
        lines = []
        if content or (reasoning and self.think):
            lines.append(self._piece(content, reasoning))
        if out.finished:
            _, calls = self.text.calls()  # Ollama sends a turn's calls whole, in one message
            if calls:
                lines.append(self._piece("", "", calls))
            lines.append(self._done(gen, out, self._piece("")))
        if self.tok is not None and out.outputs[0].delta_logprobs is not None:
            self.pending += out.outputs[0].delta_logprobs
            if lines:
                lines[0]["logprobs"], self.pending = self._logprobs(self.pending), []
        return [_line(d) for d in lines]

    def stream_error(self, gen, e: APIError) -> list[str]:
        return [_line({"error": e.message})]

    def ping(self) -> str:
        return ""  # NDJSON has no comment line: nothing is sent while waiting


class OllamaEmbedRendering(Rendering):
    """/api/embed (`embeddings`, one per input) or the legacy /api/embeddings (`embedding`, one prompt)."""

    def __init__(self, model: str, legacy: bool = False) -> None:
        self.model, self.legacy = model, legacy

    def body(self, gen) -> dict:
        vectors = [gen.finals[i].embedding for i in sorted(gen.finals)]
        if self.legacy:
            return {"embedding": vectors[0]}
        return {
            "model": self.model,
            "embeddings": vectors,
            "total_duration": _ns(max(o.metrics.finished_time or 0 for o in gen.finals.values()) - gen.arrival)
            if all(o.metrics for o in gen.finals.values())
            else 0,
            "load_duration": 0,
            "prompt_eval_count": gen.counts()[0],
        }


# -- model descriptions ---------------------------------------------------------------------------------
def tagged(name: str) -> str:
    """An Ollama model name: `name:latest` unless it has a tag."""
    return name if ":" in name else f"{name}:latest"


def _disk(path: str) -> tuple[int, float]:
    """(bytes, newest mtime) of a model file or folder."""
    if os.path.isfile(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime
    size, mtime = 0, 0.0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.stat(os.path.join(root, f))
            except OSError:
                continue
            size, mtime = size + st.st_size, max(mtime, st.st_mtime)
    return size, mtime


def parameter_count(mc) -> int:
    """The decoder's parameters, from its configuration (quantized weights are packed: counting tensors
    would not give it)."""
    attn = mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    if mc.num_experts:
        mlp = 3 * mc.hidden_size * mc.moe_intermediate_size * mc.num_experts + mc.hidden_size * mc.num_experts
    else:
        mlp = 3 * mc.hidden_size * mc.intermediate_size
    embed = mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
    return embed + mc.num_layers * (attn + mlp + 2 * mc.hidden_size) + mc.hidden_size


def size_label(n: int) -> str:
    """Ollama's parameter_size (its format.HumanNumber): 8B, 3.2B, 134.52M, 135M, 22K."""
    for unit, scale, digits in (("B", 10**9, 1), ("M", 10**6, 2)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.{digits}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def family(mc) -> str:
    kind = getattr(mc.hf_config, "model_type", None)
    return kind or mc.architecture.lower().removesuffix("forcausallm")


_FILE_FACTS: dict[tuple, object] = {}  # (path, size, mtime) -> GGUFFacts or None, read once per file version


def _file_facts(path: str, size: int, mtime: float):
    """A GGUF file's facts (its metadata only: a memory map, no weights read); None for a folder or a bad file."""
    key = (path, size, mtime)
    if key not in _FILE_FACTS:
        facts = None
        if path.endswith(".gguf"):
            from llmserve.model.loader.gguf import open_gguf
            from llmserve.model.loader.gguf_facts import gguf_facts

            try:
                facts = gguf_facts(open_gguf(path))
            except (ValueError, OSError):
                facts = None  # (loading it says why)
        _FILE_FACTS[key] = facts
    return _FILE_FACTS[key]


def describe_file(path: str) -> dict:
    """What /api/tags says of a model of --models-dir that is not loaded: its file's size, digest and date, and
    a GGUF file's family, parameter size and quantization level from its metadata."""
    size, mtime = _disk(path)
    facts = _file_facts(path, size, mtime)
    return {
        "size": size,
        "digest": hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest(),
        "modified_at": rfc3339(mtime or 0),
        "details": {
            "parent_model": "",
            "format": "gguf" if path.endswith(".gguf") else "safetensors",
            "family": facts.architecture if facts else "",
            "families": [facts.architecture] if facts else None,
            "parameter_size": size_label(facts.parameter_count) if facts else "",
            "quantization_level": facts.file_type if facts else "",
        },
    }


# the weights' dtype as Ollama names an unquantized model's quantization_level
_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def describe(engine) -> dict:
    """What /api/tags, /api/show and /api/ps say of the served model (`engine`: the LLMEngine). The digest
    is of the path, size and mtime, not of the content (hashing gigabytes on a listing is not worth it)."""
    cached = getattr(engine, "_ollama_description", None)
    if cached is not None:
        return cached
    mc = engine.model_config
    size, mtime = _disk(engine.model_path)
    facts = getattr(engine, "gguf_facts", None)  # a GGUF file's own type and count (model/loader/gguf_facts.py)
    gguf = facts is not None
    if gguf:
        quant, fam, params = facts.file_type, facts.architecture or family(mc), facts.parameter_count
    else:
        quant = engine.config.quantization or _DTYPES.get(str(engine.dtype), str(engine.dtype))
        fam, params = family(mc), parameter_count(mc)
    families = [fam, "clip"] if getattr(engine.source, "mmproj", None) else [fam]
    desc = {
        "size": size,
        "digest": hashlib.sha256(f"{engine.model_path}:{size}:{mtime}".encode()).hexdigest(),
        "modified_at": rfc3339(mtime or 0),
        "details": {
            "parent_model": "",
            "format": "gguf" if gguf else "safetensors",
            "family": fam,
            "families": families,
            "parameter_size": size_label(params),
            "quantization_level": quant.upper(),
        },
        "model_info": {
            "general.architecture": fam,
            "general.parameter_count": params,
            f"{fam}.context_length": engine.max_model_len,
            f"{fam}.embedding_length": mc.hidden_size,
            f"{fam}.block_count": mc.num_layers,
            f"{fam}.attention.head_count": mc.num_heads,
            f"{fam}.attention.head_count_kv": mc.num_kv_heads,
            f"{fam}.vocab_size": mc.vocab_size,
        },
    }
    engine._ollama_description = desc
    return desc
