"""Datasets: where the prompts and their output lengths come from.

  random    prompts of an exact token length (a range draws uniformly), made from a shuffled word
            pool, cut to length in token space and checked by re-tokenising;
  prefix    one shared prefix of N tokens plus a random suffix per request (prefix caching);
  sharegpt  a ShareGPT-format JSON file: the first human turn is the prompt, the length of the
            answer that follows is the output length (the project ships a small self-made sample);
  prompts   a text file (one prompt per line) or JSONL ({"prompt": ...} or {"messages": [...]},
            optionally "max_tokens").

Token counts come from a tokenizer: the server's own `/tokenize` + `/detokenize` when it has them
(llmserve, vLLM, llama.cpp), else a local Hugging Face tokenizer (`--tokenizer PATH`), else a
word-level approximation (one token per word or punctuation mark).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import httpx

from .client import BenchRequest

SAMPLE_SHAREGPT = "sharegpt_sample.json"


def sample_path() -> Path:
    return Path(str(resources.files("llmserve.bench") / "data" / SAMPLE_SHAREGPT))


# ---------------------------------------------------------------------------------------------
# Tokenizers: async encode/decode so the server's own can stand behind the same interface


class WordTokenizer:
    """Offline approximation: one token per word or punctuation mark; decode joins with spaces."""

    name = "words (approximate)"
    exact = False
    max_model_len: int | None = None
    _pattern = re.compile(r"\w+|[^\w\s]")

    def __init__(self) -> None:
        self.vocab: list[str] = []
        self.ids: dict[str, int] = {}

    def encode_sync(self, text: str) -> list[int]:
        out = []
        for word in self._pattern.findall(text):
            if word not in self.ids:
                self.ids[word] = len(self.vocab)
                self.vocab.append(word)
            out.append(self.ids[word])
        return out

    def decode_sync(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in ids)

    async def encode(self, text: str) -> list[int]:
        return self.encode_sync(text)

    async def decode(self, ids: list[int]) -> str:
        return self.decode_sync(ids)


class HFTokenizer:
    """A local Hugging Face tokenizer (a folder with tokenizer.json, or a cached hub id)."""

    exact = True
    max_model_len: int | None = None

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.name = f"local {path}"

    async def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    async def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class ServerTokenizer:
    """The server's `/tokenize` and `/detokenize` (vLLM and llmserve shapes; llama.cpp's too)."""

    exact = True
    name = "server /tokenize"

    def __init__(self, http: httpx.AsyncClient, model: str | None) -> None:
        self.http, self.model = http, model
        self.max_model_len: int | None = None
        self._shape = 0  # index into _bodies of the request shape this server accepts

    def _bodies(self, text: str) -> list[dict]:
        return [
            {"model": self.model, "prompt": text, "add_special_tokens": False},  # vLLM
            {"model": self.model, "prompt": text},  # a strict llmserve-like server
            {"content": text},
        ]  # llama.cpp

    async def encode(self, text: str) -> list[int]:
        bodies = self._bodies(text)
        while True:
            r = await self.http.post("/tokenize", json=bodies[self._shape])
            # (llama-server answers 200 and no tokens to a body without its `content`: the next shape too)
            empty = r.status_code == 200 and text and not r.json().get("tokens")
            if (r.status_code in (400, 422) or empty) and self._shape + 1 < len(bodies):
                self._shape += 1
                continue
            r.raise_for_status()
            data = r.json()
            self.max_model_len = data.get("max_model_len") or self.max_model_len
            return list(data["tokens"])

    async def decode(self, ids: list[int]) -> str:
        r = await self.http.post("/detokenize", json={"model": self.model, "tokens": ids})
        r.raise_for_status()
        data = r.json()
        return data["prompt"] if "prompt" in data else data["content"]

    @classmethod
    async def probe(cls, http: httpx.AsyncClient, model: str | None) -> "ServerTokenizer | None":
        tok = cls(http, model)
        try:
            ids = await tok.encode("Hello world")
            await tok.decode(ids)
            return tok
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return None


async def pick_tokenizer(http: httpx.AsyncClient, model: str | None, choice: str = "auto"):
    """`auto`: the server's if it has one, else words; `server`, `words`, or a local path/id."""
    if choice in ("auto", "server"):
        tok = await ServerTokenizer.probe(http, model)
        if tok is not None:
            return tok
        if choice == "server":
            raise RuntimeError("the server has no working /tokenize and /detokenize")
        return WordTokenizer()
    if choice == "words":
        return WordTokenizer()
    return HFTokenizer(choice)


async def count_tokens(tok, text: str) -> int:
    return len(await tok.encode(text)) if text else 0


# ---------------------------------------------------------------------------------------------
# Datasets


@dataclass
class DatasetConfig:
    name: str = "sharegpt"  # random | prefix | sharegpt | prompts
    path: str | None = None  # sharegpt / prompts file; sharegpt defaults to the shipped sample
    input_len: tuple[int, int] = (128, 128)  # random / prefix: tokens (the random suffix)
    output_len: tuple[int, int] | None = None  # None: the dataset's own, else 128
    prefix_len: int = 256  # prefix dataset: shared tokens
    seed: int = 0


def parse_range(text: str) -> tuple[int, int]:
    """`128` -> (128, 128); `100-200` -> (100, 200)."""
    lo, _, hi = str(text).partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 0 or hi_i < lo_i:
        raise ValueError(f"bad length range {text!r}")
    return lo_i, hi_i


async def build_requests(cfg: DatasetConfig, count: int, tok) -> list[BenchRequest]:
    rng = random.Random(cfg.seed)
    if cfg.name in ("random", "prefix"):
        return await _synthetic(cfg, count, tok, rng)
    if cfg.name == "sharegpt":
        return await _sharegpt(cfg, count, tok, rng)
    if cfg.name == "prompts":
        return await _prompts(cfg, count, tok, rng)
    raise ValueError(f"unknown dataset {cfg.name!r}")


def _draw(rng: random.Random, rng_range: tuple[int, int]) -> int:
    return rng.randint(*rng_range)


async def _gather(coros, limit: int = 8):
    sem = asyncio.Semaphore(limit)

    async def run(c):
        async with sem:
            return await c

    return await asyncio.gather(*(run(c) for c in coros))


async def _synthetic(cfg: DatasetConfig, count: int, tok, rng: random.Random) -> list[BenchRequest]:
    words = re.findall(r"\S+", " ".join(t for pair in load_sharegpt(sample_path()) for t in pair))
    rng.shuffle(words)
    pool = await tok.encode(" ".join(words))
    out_range = cfg.output_len or (128, 128)
    lead: list[int] = []
    if cfg.name == "prefix":
        start = rng.randrange(len(pool))
        lead = [pool[(start + k) % len(pool)] for k in range(cfg.prefix_len)]
    jobs = []
    for _ in range(count):
        n_in = len(lead) + _draw(rng, cfg.input_len)
        jobs.append((n_in, _draw(rng, out_range), rng.randrange(len(pool))))

    async def make(n_in: int, n_out: int, offset: int) -> BenchRequest:
        text, n = await exact_length_text(tok, lead, pool, offset, n_in)
        return BenchRequest(prompt=text, prompt_len=n, output_len=n_out)

    return await _gather(make(*j) for j in jobs)


async def exact_length_text(tok, lead: list[int], pool: list[int], offset: int, n: int) -> tuple[str, int]:
    """Text that re-tokenises to exactly n tokens (nearly always; else the closest found)."""
    ids = lead + [pool[(offset + k) % len(pool)] for k in range(max(0, n - len(lead)))]
    text, got = "", -1
    for _ in range(6):
        text = await tok.decode(ids)
        got = await count_tokens(tok, text)
        if got == n:
            break
        if got > n:  # merges at the cut, or specials: drop the surplus from the end
            ids = ids[: max(len(lead), len(ids) - (got - n))]
        else:
            k = len(ids) - len(lead)
            ids = ids + [pool[(offset + k + j) % len(pool)] for j in range(n - got)]
    return text, got


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the answer to it) for every usable conversation in a ShareGPT file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("messages") or []
        if len(turns) < 2:
            continue
        role = [t.get("from") or t.get("role") for t in turns[:2]]
        text = [t.get("value") or t.get("content") or "" for t in turns[:2]]
        if role[0] in ("human", "user") and role[1] in ("gpt", "assistant", "chatgpt", "model"):
            if text[0].strip() and text[1].strip():
                pairs.append((text[0], text[1]))
    return pairs


async def _sharegpt(cfg: DatasetConfig, count: int, tok, rng: random.Random) -> list[BenchRequest]:
    pairs = load_sharegpt(cfg.path or sample_path())
    if not pairs:
        raise ValueError(f"no human/assistant conversations in {cfg.path}")
    order = list(range(len(pairs)))
    rng.shuffle(order)

    drawn = {i: _draw(rng, cfg.output_len) for i in order} if cfg.output_len else {}

    async def measure(i: int) -> BenchRequest | None:
        prompt, answer = pairs[i]
        n_in = await count_tokens(tok, prompt)
        n_out = drawn[i] if drawn else await count_tokens(tok, answer)
        limit = tok.max_model_len
        if n_in < 4 or n_out < 4 or (limit and n_in + n_out > limit):  # as vllm bench's filter
            return None
        return BenchRequest(prompt=prompt, prompt_len=n_in, output_len=n_out)

    usable: list[BenchRequest] = []
    # measure only what is needed: a full ShareGPT dump has ~90k conversations
    for chunk_start in range(0, len(order), max(16, count)):
        found = await _gather(measure(i) for i in order[chunk_start : chunk_start + max(16, count)])
        usable += [r for r in found if r is not None]
        if len(usable) >= count:
            break
    if not usable:
        raise ValueError("no conversation fits the length filters")
    return [usable[k % len(usable)] for k in range(count)]  # cycle when the file is small


async def _prompts(cfg: DatasetConfig, count: int, tok, rng: random.Random) -> list[BenchRequest]:
    if not cfg.path:
        raise ValueError("--dataset prompts needs --dataset-path FILE (.txt or .jsonl)")
    items: list[tuple[str, list | None, int | None]] = []
    for line in Path(cfg.path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if cfg.path.endswith((".jsonl", ".json")):
            obj = json.loads(line)
            msgs = obj.get("messages")
            prompt = (
                obj.get("prompt") or obj.get("text") or ("\n".join(m.get("content", "") for m in msgs) if msgs else "")
            )
            items.append((prompt, msgs, obj.get("max_tokens") or obj.get("output_len")))
        else:
            items.append((line, None, None))
    if not items:
        raise ValueError(f"no prompts in {cfg.path}")

    drawn = [_draw(rng, cfg.output_len or (128, 128)) for _ in range(count)]

    async def make(k: int) -> BenchRequest:
        prompt, msgs, n_out = items[k % len(items)]
        return BenchRequest(
            prompt=prompt, prompt_len=await count_tokens(tok, prompt), output_len=int(n_out or drawn[k]), messages=msgs
        )

    return await _gather(make(k) for k in range(count))
