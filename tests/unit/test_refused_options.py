"""Options llmserve does not implement are refused with an error naming them, never silently ignored (and the
ones it once refused are now accepted)."""

import pytest
from pydantic import ValidationError

from llmserve.config import EngineConfig
from llmserve.sampling_params import SamplingParams
from llmserve.server.api.completions import CompletionRequest


def test_swap_space_is_refused():
    EngineConfig(swap_space=0)  # the default: accepted
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(swap_space=4)


def test_prompt_logprobs_and_echo_with_logprobs_are_accepted():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=21).prompt_logprobs == 21  # the engine's --max-logprobs bounds it
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    CompletionRequest(prompt="x", prompt_logprobs=5)
    CompletionRequest(prompt="x", echo=True, logprobs=1)
    CompletionRequest(prompt="x", echo=True, logprobs=1, max_tokens=0)  # lm-eval's loglikelihood_rolling
    with pytest.raises(ValidationError, match="max_tokens"):
        CompletionRequest(prompt="x", max_tokens=0)  # no output and no echo: nothing to answer
    with pytest.raises(ValidationError, match="prompt_logprobs"):
        CompletionRequest(prompt="x", prompt_logprobs=-1)
