"""Options llmserve does not implement are refused with an error naming them, never silently ignored."""

import pytest
from pydantic import ValidationError

from llmserve.config import EngineConfig
from llmserve.sampling_params import SamplingParams
from llmserve.server.api.completions import CompletionRequest


def test_swap_space_is_refused():
    EngineConfig(swap_space=0)  # the default: accepted
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(swap_space=4)


def test_prompt_logprobs_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1)
    with pytest.raises(ValidationError, match="prompt log-probabilities"):
        CompletionRequest(prompt="x", prompt_logprobs=0)


def test_echo_with_logprobs_is_refused():
    CompletionRequest(prompt="x", echo=True)  # echo alone, and logprobs alone, work
    CompletionRequest(prompt="x", logprobs=2)
    with pytest.raises(ValidationError, match="echo"):
        CompletionRequest(prompt="x", echo=True, logprobs=1)
