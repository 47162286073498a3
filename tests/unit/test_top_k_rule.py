"""vLLM's rule for reduced precision (llmserve.model.evaluate.top_k_divergence), the bar the int8-KV, bfloat16
and quantized paths are held to against float32: at the first differing greedy token, each side's token is in the
other's top-k."""

from __future__ import annotations

from llmserve.model.evaluate import top_k_divergence

TOPS = [[5, 6, 7, 8, 9]] * 4


def test_identical_sequences_pass():
    assert top_k_divergence([5, 5, 5], TOPS, [5, 5, 5], TOPS) is None


def test_divergence_inside_both_top_k_passes_and_later_positions_are_not_compared():
    a_tops = [[1, 2, 3, 4, 5], [10, 11, 12, 13, 14], [0, 0, 0, 0, 0]]
    b_tops = [[1, 2, 3, 4, 5], [11, 10, 12, 13, 14], [0, 0, 0, 0, 0]]
    assert top_k_divergence([1, 10, 99], a_tops, [1, 11, 42], b_tops) is None


def test_a_token_outside_the_other_top_k_is_named():
    a_tops = [[1, 2, 3, 4, 5], [10, 11, 12, 13, 14]]
    b_tops = [[1, 2, 3, 4, 5], [20, 21, 22, 23, 10]]
    why = top_k_divergence([1, 10], a_tops, [1, 20], b_tops)
    assert why is not None and why.startswith("position 1:") and "second's token 20" in why
    assert "first's token 10" not in why  # 10 is in b's top-5
    assert top_k_divergence([1, 10], a_tops, [1, 20], b_tops, k=4) is not None


def test_k_limits_the_ranks_read():
    a_tops = [[1, 2, 3]]
    b_tops = [[2, 1, 3]]
    assert top_k_divergence([1], a_tops, [2], b_tops, k=2) is None
    assert "top-1" in top_k_divergence([1], a_tops, [2], b_tops, k=1)
