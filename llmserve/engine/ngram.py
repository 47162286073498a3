"""Speculative decoding without a draft model: n-gram (prompt lookup) proposals.

The last few tokens of a request are looked up earlier in its own prompt and output; the tokens that
followed the latest earlier occurrence are proposed as the next ones. The engine verifies all of them
in one forward (each proposed position yields logits) and keeps the longest prefix that greedy
decoding would have produced, plus the token the model picks after it, so output is unchanged.
Pays off where output repeats its input: editing given code, summarising or quoting a given text.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (n from `max_ngram` down to `min_ngram`) of `tokens`, searched in the last `window` tokens."""
    if k <= 0 or len(tokens) < min_ngram + 1:
        return []
    arr = np.asarray(tokens[-window:], dtype=np.int64)
    L = len(arr)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        pattern = arr[L - n :]
        # starts of every earlier window equal to the pattern (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
