"""The offline API, shaped like vLLM's:

from llmserve import LLM, SamplingParams
llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32, temperature=0))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from typing import Sequence

from llmserve.config import EngineConfig
from llmserve.engine.engine import LLMEngine
from llmserve.engine.request import CompletionOutput, RequestOutput, SamplingParams
from llmserve.model.vision.inputs import prompt_images

# A prompt as vLLM's LLM.generate takes it: text, token ids, or a TextPrompt / TokensPrompt dict
# ({"prompt": "..."} or {"prompt_token_ids": [...]}, either with an optional "cache_salt").
Prompt = str | list[int] | dict


def _is_one_prompt(prompts) -> bool:
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
    )


def _parse_prompt(prompt: Prompt, index: int) -> tuple[str | None, list[int] | None, str | None]:
    """(text, token ids, cache salt) of one prompt; exactly one of text and ids is set."""
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown:
            raise ValueError(
                f"prompts[{index}]: unsupported keys {sorted(unknown)} (llmserve takes text: "
                f"'prompt', or token ids: 'prompt_token_ids', and 'cache_salt')"
            )
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"prompts[{index}]: give exactly one of 'prompt' and 'prompt_token_ids'")
        salt = prompt.get("cache_salt")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"prompts[{index}]: 'prompt' must be a string")
            return prompt["prompt"], None, salt
        prompt = prompt["prompt_token_ids"]
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompts[{index}]: 'prompt_token_ids' must be a list of token ids")
        return None, list(prompt), salt
    if isinstance(prompt, (list, tuple)):  # (ids that carry images stay as they are: model.vision.PromptWithImages)
        return None, prompt if prompt_images(prompt) else list(prompt), None
    raise ValueError(
        f"prompts[{index}]: a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}"
    )


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """`lora_request` (with enable_lora): a LoRARequest or an adapter's name for every prompt, or a
        list of them (None: the base model), as vLLM's."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:  # the model's generation config's defaults (--generation-config), as vLLM
            sampling_params = SamplingParams(**self.engine.default_sampling)
        params = (
            list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError("sampling_params: give one, or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request: give one, or one per prompt")
        return self._run(prompts, params, use_tqdm, priority, loras)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request=None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [tok.encode_chat(c, add_generation_prompt=add_generation_prompt) for c in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
        for out, conv in zip(outs, conversations):
            out.prompt = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        return outs

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: str = "last", use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Embeddings: each prompt's final hidden states pooled ("last" token or "mean"), normalized, in
        the outputs' `embedding`."""
        return self.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling), use_tqdm)

    def _run(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        use_tqdm: bool,
        priority: Sequence[int] | None,
        loras: list | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        # Validate everything before queueing anything, so a bad prompt queues nothing.
        parsed = [_parse_prompt(p, i) for i, p in enumerate(prompts)]
        encoded = [engine.tokenizer.encode(text) if ids is None else ids for text, ids, _ in parsed]
        for ids, p in zip(encoded, params):
            engine.validate_prompt(ids, p)
        loras = [engine.resolve_lora(lr) for lr in (loras or [None] * len(prompts))]
        children: dict[str, tuple[int, int]] = {}  # child request id -> (prompt index, sample index)
        for i, (ids, p) in enumerate(zip(encoded, params)):
            for j in range(p.n):
                child = p if p.n == 1 else p.clone(n=1, seed=None if p.seed is None else p.seed + j)
                rid = f"llm-{next(self._ids)}"
                engine.add_request(
                    ids,
                    child,
                    request_id=rid,
                    priority=priority[i] if priority else 0,
                    cache_salt=parsed[i][2],
                    lora_request=None if loras[i] is None else loras[i].name,
                )
                children[rid] = (i, j)
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(children), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while len(finals) < len(children):
                for out in engine.step():
                    if out.finished and out.request_id in children:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not engine.has_unfinished_requests() and len(finals) < len(children):
                    raise RuntimeError("engine stopped with requests unfinished")
        except BaseException:
            for rid in children:
                if rid not in finals:
                    engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        results: list[RequestOutput | None] = [None] * len(prompts)
        for rid, (i, j) in children.items():
            out = finals[rid]
            comp: CompletionOutput = out.outputs[0]
            comp.index = j
            if results[i] is None:
                out.prompt = parsed[i][0]
                results[i] = out
            else:
                results[i].outputs.append(comp)
        for r in results:
            r.outputs.sort(key=lambda c: c.index)
        return results
