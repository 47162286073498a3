"""Reasoning content: a thinking model's `<think>…</think>` span split from its answer (--reasoning-parser).

The split works on the decoded text, so the markers may be several tokens (or arrive split across stream
deltas): text that could still be the start of a marker is held back until the next delta decides.
Two parsers, named as vLLM names them:

- `deepseek_r1`: the output starts in reasoning (the chat template opened `<think>`); a leading `<think>` is
  skipped; everything up to `</think>` is reasoning, and an output cut off before it is all reasoning.
- `qwen3`: reasoning only when the output opens with `<think>`; an output that does not (thinking disabled,
  or a model that answers at once) is all content.

Whitespace between the markers and the text they delimit is dropped. `--reasoning-start-marker` and
`--reasoning-end-marker` change the markers (default `<think>`, `</think>`). The markers must decode as
text: a tokenizer that marks them as special tokens drops them with skip_special_tokens.

Chat answers carry the reasoning as `reasoning_content` (message and deltas); the Responses API as a
`reasoning` output item; the Messages API as a `thinking` block.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> the output starts inside the reasoning
DEFAULT_START, DEFAULT_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    start: str = DEFAULT_START
    end: str = DEFAULT_END
    implicit_start: bool = False

    @classmethod
    def from_name(cls, name: str | None, start: str | None = None, end: str | None = None) -> "ReasoningParser | None":
        """The parser --reasoning-parser names; None without one."""
        if not name:
            return None
        if name not in PARSERS:
            raise ValueError(f"--reasoning-parser: unknown parser {name!r}; choose from {', '.join(PARSERS)}")
        start, end = start or DEFAULT_START, end or DEFAULT_END
        if start == end:
            raise ValueError("--reasoning-start-marker and --reasoning-end-marker must differ")
        return cls(start, end, PARSERS[name])

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output: the same as streaming it and joining the pieces."""
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.flush()
        return r1 + r2, c1 + c2


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may be completed later)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One output's split as its text arrives: feed(delta) -> (reasoning delta, content delta); flush() at the
    end releases what was held back."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.p = parser
        self.state = "start"  # start -> (reasoning_lead -> reasoning -> content_lead)? -> content
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = [], []
        while self.buf:
            if self.state == "start":
                text = self.buf.lstrip()
                if text.startswith(self.p.start):
                    self.buf, self.state = text[len(self.p.start) :], "reasoning_lead"
                elif not text or self.p.start.startswith(text):
                    break  # whitespace, or maybe the start marker: wait for more
                elif self.p.implicit_start:
                    self.buf, self.state = text, "reasoning_lead"
                else:
                    self.state = "content"
            elif self.state in ("reasoning_lead", "content_lead"):
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = self.state[:-5]
            elif self.state == "reasoning":
                at = self.buf.find(self.p.end)
                if at >= 0:
                    reasoning.append(self.buf[:at])
                    self.buf, self.state = self.buf[at + len(self.p.end) :], "content_lead"
                    continue
                keep = _held(self.buf, self.p.end)
                reasoning.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            else:
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The end of the output: held-back text goes where the state says."""
        buf, self.buf = self.buf, ""
        if self.state == "start":
            return (buf.lstrip(), "") if self.p.implicit_start and buf.strip() else ("", buf)
        if self.state in ("reasoning_lead", "reasoning"):
            return buf, ""
        return "", buf if self.state == "content" else ""
