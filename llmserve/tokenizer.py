"""Tokenizer, chat template and an incremental, byte-correct detokenizer.

For GGUF models the tokenizer, chat template and special tokens come from the file's metadata
(converted by transformers once, then cached on disk); for checkpoint folders from tokenizer.json and
tokenizer_config.json.
"""

from __future__ import annotations

import hashlib
import logging
import os

from llmserve import envs

log = logging.getLogger("llmserve.tokenizer")


def _cache_dir() -> str:
    return os.path.join(envs.LLMSERVE_CACHE_DIR, "tokenizers")


def _load_hf_tokenizer(path: str, gguf: bool):
    import transformers

    if not gguf:
        return transformers.AutoTokenizer.from_pretrained(path)
    st = os.stat(path)
    key = hashlib.sha256(
        f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}".encode()
    ).hexdigest()[:16]
    cached = os.path.join(_cache_dir(), key)
    if os.path.exists(os.path.join(cached, "tokenizer.json")):
        return transformers.AutoTokenizer.from_pretrained(cached)
    folder, name = os.path.dirname(path), os.path.basename(path)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, TypeError) as e:  # an architecture transformers' GGUF reader lacks (granite, smollm3, olmo2,
        # glm4) or fails on (gpt-oss: its rope.scaling keys, a TypeError in 5.24): the tokenizer.ggml.* fields are the
        # same for every one, read them directly
        if isinstance(e, ValueError) and "not supported" not in str(e):
            raise
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    try:
        tmp = cached + f".tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError as e:  # a read-only home is fine: we just convert again next time
        log.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok


class Tokenizer:
    """Encode, decode, render chat templates. Wraps a transformers fast tokenizer."""

    def __init__(self, path: str, gguf: bool = False) -> None:
        self.hf = _load_hf_tokenizer(path, gguf)
        self.fast = self.hf.backend_tokenizer if hasattr(self.hf, "backend_tokenizer") else None
        self.vocab_size = len(self.hf)
        self.eos_token_id = self.hf.eos_token_id
        self.bos_token_id = self.hf.bos_token_id
        self.all_special_ids = set(self.hf.all_special_ids)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def set_chat_template(self, template: str) -> None:
        """Render chats with `template` (a Jinja chat template) instead of the model's."""
        self.hf.chat_template = template
        self.has_chat_template = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.fast is not None:
            return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs
    ) -> str:
        if not self.has_chat_template:
            raise ValueError("messages: this model has no chat template; use the completions API")
        return self.hf.apply_chat_template(
            messages, tokenize=False, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        # The template already holds every special token it needs.
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, never emitting half of a UTF-8 character, and
    cuts at stop strings (also when they span tokens). Text that might be the start of a stop string
    is held back until it is known not to be one, so streamed text always equals the final text.

    Decoding works on a short window (`prefix_offset:`) so that each step costs O(1), and a few prompt
    tokens seed the window so the first output token gets its leading space right."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text decoded so far (before any stop cut)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, new_ids: list[int], finished: bool = False) -> str:
        """Add tokens, return the new text that is safe to emit."""
        if self.stopped is not None:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (finished or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._emit(finished)

    def _emit(self, finished: bool) -> str:
        if self.stop:
            best = None
            for s in self.stop:
                i = self.text.find(s, self.emitted)
                if i != -1 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                self.stopped = s
                end = i + len(s) if self.include_stop else i
                out = self.text[self.emitted : end]
                self.emitted = end
                return out
        safe = len(self.text) if finished else len(self.text) - self.hold
        if safe <= self.emitted:
            return ""
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out

    @property
    def output_text(self) -> str:
        return self.text[: self.emitted]
