"""Prompts for the parity tests: chat prompts of mixed lengths, one longer than the token budget."""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_SCHED = os.path.join(_HERE, "..", "..", "llmserve", "engine", "scheduler.py")

CHATS = [
    "What is Docker? Answer in one sentence.",
    "Hi!",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a hash table is to a ten year old, in two or three sentences.",
    "Translate 'good morning' into French and Spanish.",
]


def long_document(chars: int = 2400) -> str:
    with open(_SCHED) as f:
        code = f.read()
    return "Summarize what this Python code does:\n\n" + code[:chars]


def chat_messages() -> list[list[dict]]:
    convs = [[{"role": "user", "content": c}] for c in CHATS]
    convs.append(
        [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": long_document(1200)}]
    )
    convs.append([{"role": "user", "content": long_document(2400)}])
    return convs
