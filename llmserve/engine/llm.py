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

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError("sampling_params: give one, or one per prompt")
        return self._run(prompts, params, use_tqdm, priority)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [tok.encode_chat(c, add_generation_prompt=add_generation_prompt) for c in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out, conv in zip(outs, conversations):
            out.prompt = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        return outs

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool,
             priority: Sequence[int] | None) -> list[RequestOutput]:
        engine = self.engine
        # Validate everything before queueing anything, so a bad prompt queues nothing.
        encoded = [engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p in zip(encoded, params):
            engine.validate_prompt(ids, p)
        children: dict[str, tuple[int, int]] = {}      # child request id -> (prompt index, sample index)
        for i, (ids, p) in enumerate(zip(encoded, params)):
            for j in range(p.n):
                child = p if p.n == 1 else p.clone(n=1, seed=None if p.seed is None else p.seed + j)
                rid = f"llm-{next(self._ids)}"
                engine.add_request(ids, child, request_id=rid,
                                   priority=priority[i] if priority else 0)
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
                out.prompt = prompts[i] if isinstance(prompts[i], str) else None
                results[i] = out
            else:
                results[i].outputs.append(comp)
        for r in results:
            r.outputs.sort(key=lambda c: c.index)
        return results
