"""Ollama's `options` and `format` as the chat machinery's sampling fields, with Ollama's defaults.

A request's `options` win; what they leave out comes from the model's own parameters (what a Modelfile's
PARAMETER lines are to Ollama: the model's generation config, --override-generation-config or its models.yaml
entry's override-generation-config, and a GGUF file's `general.sampling.*` metadata), then from Ollama's
documented defaults (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1 over the last 64 tokens). A
client that sends no options (Open WebUI) thus samples as it would from Ollama, not at the OpenAI routes'
temperature 1 without top-k; those keep vLLM's rules (prepare.sampling_params). /api/show lists the parameters
in effect in its `parameters` text."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from llmserve.server import protocol as P
from llmserve.server.errors import APIError, from_value_error

# Ollama's defaults (its api/types.go DefaultOptions) for the options that change sampling
OLLAMA_DEFAULTS = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.1,
    "repeat_last_n": 64,
}

# option -> SamplingFields field (the same checks and defaults as the OpenAI-style APIs)
OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "stop": "stop",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}

# the engine's default_sampling (SamplingParams' names) -> Ollama's option names
_FROM_ENGINE = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repeat_penalty",
    "max_tokens": "num_predict",
}


@dataclass
class Sampling:
    fields: P.SamplingFields
    predict: int | None  # num_predict (None: up to the context)
    ctx: int | None  # num_ctx (None: the model's)
    last_n: int | None  # repeat_last_n as SamplingParams.repetition_last_n (None: all tokens)


def model_parameters(engine) -> dict:
    """The served model's own parameters, in Ollama's option names (`engine`: the LLMEngine): a GGUF file's
    recommended sampling, then the generation config and its overrides (engine.default_sampling) over it."""
    facts = getattr(engine, "gguf_facts", None)
    own = dict(facts.sampling) if facts is not None else {}
    own.update({_FROM_ENGINE[k]: v for k, v in engine.default_sampling.items() if k in _FROM_ENGINE})
    return own


def effective_parameters(engine) -> dict:
    """What a request without options samples with: the model's own parameters over Ollama's defaults."""
    return {**OLLAMA_DEFAULTS, **model_parameters(engine)}


def parameters_text(params: dict) -> str:
    """/api/show's `parameters`: one `name value` line each, as Ollama prints a Modelfile's (a 30-wide name)."""

    def value(v) -> str:
        return f'"{v}"' if isinstance(v, str) else str(v)

    return "\n".join(f"{k:<30} {value(v)}" for k, v in sorted(params.items()))


def response_format(fmt) -> dict | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}


def _last_n(o: dict, fields: dict) -> int | None:
    """repeat_last_n -> repetition_last_n: -1 the whole context (None), 0 no repeat penalty at all."""
    n = o.get("repeat_last_n")
    if n is None or n == -1:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < -1:
        raise APIError(400, "options.repeat_last_n: must be an integer >= -1", param="options")
    if n == 0:
        fields["repetition_penalty"] = 1.0
        return None
    return n


def sampling_fields(body, defaults: dict | None = None) -> Sampling:
    """The sampling of a request's `options` and `format` (`body`: an /api/chat or /api/generate request) over
    `defaults` (effective_parameters; none: Ollama's own)."""
    given = {k: v for k, v in (body.options or {}).items() if v is not None}
    o = {**(OLLAMA_DEFAULTS if defaults is None else defaults), **given}
    fields = {OPTIONS[k]: v for k, v in o.items() if k in OPTIONS}
    if isinstance(fields.get("seed"), int) and fields["seed"] < 0:  # Ollama's -1: a random seed
        fields.pop("seed")
    try:
        last_n = _last_n(o, fields)
        sf = P.SamplingFields(**fields, response_format=response_format(body.format))
        predict, ctx = o.get("num_predict"), o.get("num_ctx")
        for k, v in (("num_predict", predict), ("num_ctx", ctx)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"options.{k}: must be an integer")
    except ValidationError as e:
        err = e.errors()[0]
        inv = {v: k for k, v in OPTIONS.items()}
        where = ".".join(str(x) for x in err.get("loc", ()))
        where = "format" if where.startswith("response_format") else f"options.{inv.get(where, where)}"
        raise APIError(400, f"{where}: {err.get('msg')}", param=where.split(".")[0]) from e
    except ValueError as e:
        raise from_value_error(e) from e
    return Sampling(
        sf, predict if predict is not None and predict > 0 else None, ctx if ctx and ctx > 0 else None, last_n
    )


def with_last_n(runs, last_n: int | None):
    """The runs (serving.Run) with repeat_last_n set on their SamplingParams."""
    if last_n is not None:
        for run in runs:
            run[3].repetition_last_n = last_n
    return runs
