"""From a validated request body to what the engine runs: the chat rendered and tokenized (refusing
special tokens in message content), SamplingParams (context length checks, guided decoding and forced
tool calls), the grammar compiled, n choices fanned out into runs, and admission checked before the
answer starts (`chat_runs` does all of it for the chat-shaped APIs: chat, Responses, Messages). Every
refusal is an APIError (400, or 429 / 503 at admission)."""

from __future__ import annotations

import asyncio

from llmserve.engine.async_engine import AsyncEngine, EngineDeadError
from llmserve.engine.request import SamplingParams
from llmserve.engine.scheduler import QueueFullError
from llmserve.model.vision.processing import prompt_with_images
from llmserve.server import media
from llmserve.server import protocol as P
from llmserve.server import tool_parsers as tools_mod
from llmserve.server.errors import APIError, from_value_error
from llmserve.server.serving import to_api_error
from llmserve.server.state import ServerSettings


def encode_chat(
    tok, messages: list[P.ChatMessage], add_generation_prompt: bool, kwargs, tool_plan=None, images=None
) -> list[int]:
    """The chat's prompt token ids. `images` (a vision-language model's: (its ImageProcessing, the decoded
    images of the messages' image parts in order)): content goes to the template as parts, an image part as
    {"type": "image"}, and the ids carry the images (llmserve.model.vision.PromptWithImages)."""
    msgs = []
    specials = _special_strings(tok)
    for m in messages:
        for text in (m.text(), m.name or ""):
            hit = next((sp for sp in specials if sp in text), None)
            if hit is not None:  # rendered text is tokenized with special tokens parsed: refuse injection
                raise APIError(
                    400,
                    f"messages: content must not contain the special token {hit!r}",
                    param="messages",
                    code="invalid_value",
                )
        d = {"role": m.role, "content": m.text() if images is None else _parts(m)}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        msgs.append(d)
    native = tools_mod.template_supports_tools(tok)
    if tool_plan is not None or any(m.get("tool_calls") for m in msgs):
        msgs, tools = tools_mod.render_messages(msgs, tool_plan, native)
        if tools:
            kwargs = dict(kwargs or {}, tools=tools)
    try:
        if images is not None:  # (the tools prompt, or the template's tools, and the calls are in `msgs` as text)
            text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **(kwargs or {}))
            return prompt_with_images(tok, images[0], text, images[1])
        return tok.encode_chat(msgs, add_generation_prompt=add_generation_prompt, **(kwargs or {}))
    except APIError:
        raise
    except ValueError as e:
        raise from_value_error(e) from e
    except Exception as e:  # noqa: BLE001 - a template that raises is the request's fault
        raise APIError(400, f"messages: the chat template could not render them: {e}", param="messages") from e


def _parts(m: P.ChatMessage) -> list[dict]:
    """A message's content as a vision-language model's template takes it: text and image parts in order."""
    if m.content is None:  # (an assistant's tool calls: render_messages adds them as a text part)
        return []
    if isinstance(m.content, str):
        return [{"type": "text", "text": m.content}]
    return [{"type": "text", "text": p.text} if isinstance(p, P.TextPart) else {"type": "image"} for p in m.content]


async def chat_images(
    eng: AsyncEngine, settings: ServerSettings, messages: list[P.ChatMessage], param: str = "messages"
):
    """(the model's ImageProcessing, the messages' images decoded) for a vision-language model, None for a
    text-only one; a 400 for an image to a text-only model, too many images, or one that cannot be read."""
    processing = eng.engine.image_processing
    parts = [
        (p.image_url.url, p._where or f"{param}[{i}].content[{k}]")
        for i, m in enumerate(messages)
        if isinstance(m.content, list)
        for k, p in enumerate(m.content)
        if isinstance(p, P.ImagePart)
    ]
    if processing is None and not parts:
        return None
    try:
        eng.engine.validate_images(parts)  # a text-only model, or more than --limit-mm-per-prompt
    except ValueError as e:
        raise from_value_error(e) from e
    return processing, await media.load_images(parts, settings.allowed_media_domains)


def _special_strings(tok) -> tuple[str, ...]:
    """The special-token strings the chat template is built of ('<|im_start|>', ...; and bos/eos), which
    message content must not hold: the rendered chat is tokenized with special tokens parsed, so they
    would forge turns (a chat template injection)."""
    cached = getattr(tok, "_llmserve_specials", None)
    if cached is None:
        hf = tok.hf
        names = set(getattr(hf, "all_special_tokens", []) or [])
        for t in (getattr(hf, "added_tokens_decoder", None) or {}).values():
            if getattr(t, "special", False):
                names.add(str(t.content if hasattr(t, "content") else t))
        try:  # only those the chat template itself uses (turn markers) and bos/eos: "<filename>" stays text
            sample = tok.apply_chat_template(
                [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "a"},
                ],
                add_generation_prompt=True,
            )
        except Exception:  # noqa: BLE001 - no template: no chat requests either
            sample = ""
        keep = {getattr(hf, "eos_token", None), getattr(hf, "bos_token", None)}
        cached = tuple(sorted((n for n in names if n and (n in sample or n in keep)), key=len, reverse=True))
        tok._llmserve_specials = cached
    return cached


async def compile_guided(eng: AsyncEngine, params: SamplingParams) -> None:
    """Compile (and cache) the grammar in a worker thread, so the engine loop never waits on it and
    a bad schema is a 400 before the request is admitted."""
    if params.guided:
        try:
            await asyncio.to_thread(eng.engine.guided.compile, params)
        except ValueError as e:
            raise from_value_error(e) from e


async def chat_runs(
    eng: AsyncEngine,
    settings: ServerSettings,
    body,
    messages: list[P.ChatMessage],
    max_tokens: int | None,
    tool_plan=None,
    logprobs: int | None = None,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    prompt_param: str = "messages",
    max_tokens_param: str = "max_tokens",
    context: int | None = None,
) -> list:
    """A chat-shaped request's runs (serving.Run), checked and admitted: the messages rendered and tokenized,
    the sampling parameters of `body` (its fields as the chat API names them), the grammar compiled.
    `context`: a context window below the model's (Ollama's num_ctx)."""
    images = await chat_images(eng, settings, messages, prompt_param)
    ids = await asyncio.to_thread(
        encode_chat, eng.tokenizer, messages, add_generation_prompt, template_kwargs, tool_plan, images
    )
    params = sampling_params(
        body,
        eng,
        len(ids),
        max_tokens,
        logprobs=logprobs,
        tool_plan=tool_plan,
        prompt_param=prompt_param,
        max_tokens_param=max_tokens_param,
        context=context,
    )
    await compile_guided(eng, params)
    runs = [(i, 0, ids, p) for i, p in enumerate(fan_out(params))]
    admit(eng, runs, settings)
    return runs


def sampling_params(
    body,
    eng: AsyncEngine,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    tool_plan=None,
    prompt_param: str | None = None,
    max_tokens_param: str = "max_tokens",
    prompt_logprobs: int | None = None,
    context: int | None = None,
) -> SamplingParams:
    """SamplingParams from a request body's fields, named as the chat API names them (a body without `n`,
    `stop`, `temperature`... gets the defaults). `prompt_logprobs`: at least that many (completions' echo
    with logprobs), beside the body's own. `context`: a context window below the model's."""
    max_len = eng.engine.max_model_len if context is None else min(context, eng.engine.max_model_len)
    prompt_param = prompt_param or ("messages" if hasattr(body, "messages") else "prompt")
    if prompt_len == 0:
        raise APIError(400, f"{prompt_param}: must not be empty", param=prompt_param)
    if prompt_len >= max_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_len} tokens. However, your "
            f"prompt has {prompt_len} tokens ({prompt_len - max_len + 1} too many, leaving "
            f"room for at least one output token). Please shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    defaults = eng.engine.default_sampling  # the model's generation config: what the body leaves out

    def given(name: str, fallback):
        value = getattr(body, name, None)
        return defaults.get(name, fallback) if value is None else value

    if max_tokens is None:
        max_tokens = min(max_len - prompt_len, defaults.get("max_tokens", max_len))
    elif prompt_len + max_tokens > max_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion): {prompt_len + max_tokens - max_len} too many. "
            f"Please reduce the prompt or {max_tokens_param}.",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    try:
        guided = tools_mod.guided_kwargs(body, tool_plan)
        return SamplingParams(
            n=getattr(body, "n", 1),
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=given("top_k", 0),
            min_p=given("min_p", 0.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0),
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=min(body.min_tokens, max_tokens),
            stop=getattr(body, "stop", None),
            stop_token_ids=body.stop_token_ids,
            logit_bias=getattr(body, "logit_bias", None),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=_most(getattr(body, "prompt_logprobs", None), prompt_logprobs),
            skip_special_tokens=body.skip_special_tokens and not (tool_plan is not None and tool_plan.keeps_specials),
            include_stop_str_in_output=body.include_stop_str_in_output,
            **guided,
        )
    except ValueError as e:
        raise from_value_error(e) from e


def _most(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else max(a, b)


def admit(eng: AsyncEngine, runs, settings: ServerSettings) -> None:
    try:
        eng.check_admission(runs)
    except (ValueError, QueueFullError, EngineDeadError) as e:
        raise to_api_error(e, settings) from e


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    if params.n == 1:
        return [params]
    return [params.clone(n=1, seed=None if params.seed is None else params.seed + j) for j in range(params.n)]
