"""LLMEngine: requests in, a step at a time, outputs out.

    step():  schedule -> run the model and sample -> append tokens, stop, roll back -> text, outputs
             Scheduler     ModelRunner                Scheduler.update_from_output    OutputProcessor

The engine owns the tokenizer, the scheduler (policy and request state), the KV cache manager
(bookkeeping), the model runner (tensors) and the output processor (text); each of those knows only
what it needs.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

import torch

from llmserve.config import EngineConfig
from llmserve.engine import kv_plan
from llmserve.engine.executor import make_executor
from llmserve.engine.generation_config import default_sampling
from llmserve.engine.guided import GuidedDecoding
from llmserve.engine.kv_events import open_event_log
from llmserve.engine.kv_memory import measure_memory, profile_activations
from llmserve.engine.kv_plan import (
    kv_manager,
    layer_kinds,
    requested_bytes,
)
from llmserve.engine.kv_tiers import open_kv_tiers
from llmserve.engine.ngram import propose_ngram
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from llmserve.engine.scheduler import (  # noqa: F401 (re-exported)
    QueueFullError,
    Scheduler,
    alone_token_budget,
    default_token_budget,
)
from llmserve.engine.state_pool import hybrid_config
from llmserve.engine.step_budget import resolve_max_step_ms
from llmserve.model.kernels import ops
from llmserve.model.loader import activation_dtype, load_model_config, resolve_dtype, resolve_kv_dtype, resolve_model
from llmserve.model.loader.gguf_facts import gguf_facts
from llmserve.model.loader.mode import weight_mode
from llmserve.model.registry import image_processing
from llmserve.model.vision.inputs import mrope_positions, prompt_images
from llmserve.tokenizer import Tokenizer

log = logging.getLogger("llmserve.engine")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    steps: int
    last_step_time: float
    spec_decode_num_drafts: int = 0  # speculative decoding: verifications (a request's proposals in a step)
    spec_decode_num_draft_tokens: int = 0  # tokens proposed
    spec_decode_num_accepted_tokens: int = 0  # and accepted by verification
    block_size: int = 16  # configuration, for llmserve:cache_config_info
    cache_dtype: str = "float32"
    enable_prefix_caching: bool = True
    max_lora: int | None = None  # --max-loras with --enable-lora (else None: no LoRA metrics)
    running_lora_adapters: tuple[str, ...] = ()  # adapters of running requests
    waiting_lora_adapters: tuple[str, ...] = ()  # ... and of waiting ones
    kv_disk: dict | None = None  # --kv-cache-dir / --kv-cache-url: the tiers' counters (kv_tiers.py)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        """config -> model -> layer kinds -> memory -> KV plan -> allocate -> scheduler."""
        self.config = config = config or EngineConfig(**kwargs)
        torch.set_num_threads(config.resolved_num_threads())
        ops.configure(config.kernels)  # the model layer's kernel settings, before any layer is built
        t0 = time.time()
        mc, reader = self._read_config(config, t0)
        config = self.config  # (a hybrid model's: prefix caching off)
        self.max_num_batched_tokens = config.max_num_batched_tokens or self._token_budget(config, mc)
        # a step with no decoding row (prompts alone): the token budget given, or on CPU's default up to 2048
        self.alone_tokens = alone_token_budget(
            self.max_num_batched_tokens, self.device.type, config.max_num_batched_tokens is not None
        )
        # one process, or tensor parallelism (plans the split or refuses it, starts the workers)
        self.executor = make_executor(config, mc, self.device)
        self.device, kv_heads = self.executor.device, self.executor.kv_heads
        try:
            # the model (the loader refuses one that does not fit beside the KV bytes asked for explicitly)
            positions = (config.max_model_len or mc.max_position_embeddings) + config.num_lookahead_tokens + 1
            kv_bytes = requested_bytes(config, mc, kv_heads, self.kv_dtype)
            self.model = self.executor.load_model(self.source, reader, self.dtype, positions, kv_bytes)
            del reader
            log.info(
                "%s: weights built (%s) at %.1fs; sizing the KV cache", self.source.name, self.dtype, time.time() - t0
            )
            # layer kinds -> memory -> plan
            kinds = layer_kinds(self.model, kv_heads, self.kv_dtype, self.act_dtype)
            memory = measure_memory(config, self.device, self._profile_activations)
            self.plan = plan = kv_plan.plan(
                config, kinds, memory, model_max=mc.max_position_embeddings, token_budget=self.alone_tokens
            )
            plan.log(log)
            self.block_size, self.num_blocks, self.max_model_len = plan.block_size, plan.num_blocks, plan.max_model_len
            # allocate: the runner's tensors (and the workers'), the draft's, the tiers, the KV cache manager
            self.lora = self._lora_registry(config)  # LoRARegistry with --enable-lora: the adapters, by name
            self.executor.start(self.model, plan, self.act_dtype, self.kv_dtype, self.lora and self.lora.layers)
            self.draft = self._draft_proposer(config, mc, plan)  # DraftProposer with --speculative-model
            events = open_event_log(config.kv_events_config, plan.block_size)
            tiers = open_kv_tiers(plan, self.model_path, self.dtype, self.runner.kv_caches, lambda: self.last_step_time)
            self.kv = kv_manager(plan, events, tiers)
            # the scheduler
            max_step_ms = resolve_max_step_ms(config.max_step_ms, self.device.type)
            self.scheduler = Scheduler(
                self.kv, config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                config.scheduling_policy, config.max_queued_requests, max_step_ms, alone_tokens=self.alone_tokens,
            )  # fmt: skip
        except BaseException:
            self.shutdown()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self.guided = GuidedDecoding(self.tokenizer.hf, mc.vocab_size, sorted(self.eos_token_ids))
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)  # --seed: the seeds of requests that bring none
        self.steps = 0
        self.last_step_time = time.time()
        self.load_time = time.time() - t0
        self._log_loaded()

    def _read_config(self, config: EngineConfig, t0: float):
        """(the model's config, its GGUF reader or None): the device and dtypes resolved, the engine's config for
        this model, the model's names, tokenizer, sampling defaults and image processing read."""
        dev = config.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        source = resolve_model(config.model, config.mmproj)
        self.model_path = source.path
        self.source = source
        log.info("loading %s (%s) ...", source.name, source.path)
        self.model_config, reader = load_model_config(source)
        mc = self.model_config
        self.config = config = hybrid_config(config, mc)  # (a hybrid model: prefix caching off, refusals)
        self.config = config = weight_mode(config, source, reader, mc, self.device)  # --quantization auto -> a mode
        plain = not config.quantization and not config.enable_lora and config.tensor_parallel_size == 1
        self.dtype = resolve_dtype(config.dtype, self.device, plain)  # the weights'
        self.act_dtype = activation_dtype(self.dtype, self.device)  # float32 around bfloat16 weights on CPU
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.act_dtype, self.device)
        self.kv_dtype_name = str(self.kv_dtype).removeprefix("torch.")  # float32, float16, int8, ...
        log.info(
            "%s: %s, %d layers; config read in %.1fs", source.name, mc.architecture, mc.num_layers, time.time() - t0
        )
        # every name the model answers to (--served-model-name a b); the first is its name in answers
        self.served_model_names = list(dict.fromkeys(config.served_model_name or [source.name]))
        self.served_model_name = self.served_model_names[0]
        # the model's sampling defaults for what a request leaves out (--generation-config)
        self.default_sampling = default_sampling(
            config.generation_config, source.path if source.kind == "hf" else None, config.override_generation_config
        )
        self.gguf_facts = gguf_facts(reader)  # a GGUF's file type, parameter count, recommended sampling; or None
        self.tokenizer = Tokenizer(source.path, gguf=source.kind == "gguf")
        # a vision-language model's image processing (llmserve.model.vision.processing); None: text only
        self.image_processing = image_processing(mc, source.path)
        self.eos_token_ids = set(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        return mc, reader

    def _token_budget(self, config, mc) -> int:
        """--max-num-batched-tokens' default for this model on this device (Gemma 3's image is computed in one step:
        at least its run)."""
        images = self.image_processing
        return default_token_budget(
            mc.matmul_flops_per_token(),
            self.device.type,
            config.resolved_num_threads() * config.tensor_parallel_size,
            images.seq_len if getattr(images, "bidirectional", False) else 0,
        )

    def _draft_proposer(self, config, mc, plan):
        if not config.speculative_model:
            return None
        from llmserve.engine.draft import DraftProposer

        return DraftProposer(config, mc, self.device, self.dtype, self.act_dtype, self.kv_dtype, plan)

    def _lora_registry(self, config):
        """LoRARegistry with --enable-lora (the adapters of --lora-modules loaded), else None."""
        if not config.enable_lora:
            return None
        from llmserve.engine.lora import LoRARegistry, parse_lora_modules

        registry = LoRARegistry(
            self.model, config.max_loras, config.max_lora_rank, self.act_dtype, reserved=tuple(self.served_model_names)
        )
        for name, path in parse_lora_modules(config.lora_modules):
            registry.load(name, path)
        return registry

    def _log_loaded(self) -> None:
        plan, config = self.plan, self.config
        log.info(
            "loaded %s (%s, %s, %s) in %.1fs; KV cache (%s): %.2f GiB = %d blocks x %d tokens "
            "(%d tokens); max_model_len %d fits %d times; max_num_seqs %d, "
            "max_num_batched_tokens %d (prompts alone: %d), prefix caching %s",
            self.served_model_name,
            self.model_config.architecture,
            self.dtype,
            self.device,
            self.load_time,
            self.kv_dtype_name,
            plan.budget / kv_plan.GiB,
            plan.num_blocks,
            plan.block_size,
            plan.capacity,
            self.max_model_len,
            plan.capacity // self.max_model_len,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            self.alone_tokens,
            "on" if config.enable_prefix_caching else "off",
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op without them); the engine is unusable after."""
        if getattr(self, "kv", None) is not None and self.kv.disk is not None:
            self.kv.disk.close()
        if getattr(self, "draft", None) is not None:
            self.draft.shutdown()
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()

    def _profile_activations(self) -> int:
        n = min(self.max_num_batched_tokens, self.config.max_model_len or self.model_config.max_position_embeddings)
        with self.executor.local_only():  # rank 0's shard alone: no all-reduce
            return profile_activations(self.model, n, self.config.block_size, self.kv_dtype, self.device)

    @property
    def runner(self):
        """The model runner (the executor's; rank 0's under tensor parallelism)."""
        return self.executor.runner

    @property
    def tp(self):
        """The TensorParallel executor, or None in one process."""
        return self.executor if self.executor.world_size > 1 else None

    # -- requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        self.validate_images(prompt_images(prompt_token_ids))
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens is too long; this model's maximum context length is "
                f"{self.max_model_len} tokens (prompt plus at least one output token), "
                f"{n - self.max_model_len + 1} too many"
            )
        most = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > most:
                raise ValueError(f"{name}: {asked} requested, more than this server's most of {most} (--max-logprobs)")
        bias = params.logit_bias or {}
        if any(t >= vocab for t in bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got {max(bias)}")
        if params.guided:
            self.guided.compile(params)  # a bad schema fails here, before anything is queued (cached)
        # Like vLLM's engine, prompt + max_tokens may exceed max_model_len: generation then stops
        # at max_model_len with finish_reason "length". (The server checks the sum, as vLLM's does.)

    def validate_images(self, images: list) -> None:
        """A prompt's images: only for a vision-language model, at most --limit-mm-per-prompt of them."""
        if not images:
            return
        if self.image_processing is None:
            raise ValueError(f"messages: {self.served_model_name} is a text-only model; it does not take images")
        run = max((im.num_tokens for im in images if getattr(im, "bidirectional", False)), default=0)
        if run > self.max_num_batched_tokens:
            raise ValueError(
                f"messages: an image takes {run} tokens, which must be computed in one step: more than "
                f"--max-num-batched-tokens ({self.max_num_batched_tokens})"
            )
        most = self.config.image_limit()
        if most is not None and len(images) > most:
            raise ValueError(
                f"messages: {len(images)} images in one prompt, more than this server's most of {most} "
                f"(--limit-mm-per-prompt image={most})"
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> str:
        """`lora_request`: a loaded adapter's name, or a LoRARequest (loaded from its path if its name is
        not loaded yet); None: the base model."""
        params = params or SamplingParams()
        adapter = self.resolve_lora(lora_request)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        self.validate_prompt(ids, params)
        if params.n != 1:
            raise ValueError("n: the engine takes one sequence per request; fan out with LLM or the server")
        request_id = request_id if request_id is not None else str(next(self._ids))
        req = Request(request_id, ids, params, self.eos_token_ids, priority, arrival_time, text, cache_salt)
        req.guided = self.guided.matcher(params) if params.guided else None  # compiled once, cached
        req.lora = adapter
        req.images = prompt_images(prompt)
        if req.images and self.model_config.mrope_section:  # positions on the images' grids, once
            req.mrope = mrope_positions(len(ids), req.images)
        self.scheduler.add_request(req)
        req.generator = torch.Generator(device=self.device)  # unseeded requests: the next seed of --seed's stream
        req.generator.manual_seed(params.seed if params.seed is not None else self._seeds.getrandbits(64))
        self.output_processor.add_request(req)
        return request_id

    def resolve_lora(self, lora_request):
        """The LoRAAdapter a request names (None for the base model); ValueError if there is none."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("lora_request: LoRA adapters are not enabled (start with --enable-lora)")
        name = lora_request if isinstance(lora_request, str) else lora_request.lora_name
        adapter = self.lora.get(name)
        if adapter is None and not isinstance(lora_request, str) and lora_request.lora_path:
            adapter = self.lora.load(name, lora_request.lora_path)
        if adapter is None:
            raise ValueError(f"lora_request: no LoRA adapter named {name!r} is loaded")
        return adapter

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return None if req is None else self.output_processor.output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def fault_hook(self):
        """Tests: called with each request before its token is appended; what it raises fails that request
        (an Exception) or the engine loop (any other BaseException)."""
        return self.scheduler.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook) -> None:
        self.scheduler.fault_hook = hook

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.config.num_lookahead_tokens > 0:
            self._propose()
        sched = self.scheduler.schedule()
        self.last_step_time = time.time()
        if not sched:
            return []
        self.steps += 1
        # every row plain greedy (no logprobs): the model answers tokens, not logits (cheaper for a float32 head)
        argmax = all(r.next_token_is_argmax and r.params.logprobs is None for r in sched.requests)
        sampled = self.executor.execute(sched, argmax=argmax)
        if self.kv.disk is not None:  # blocks this step completed: copied out for the disk writer
            self.kv.disk.save(sched, self.kv)
        appended = self.scheduler.update_from_output(sched, sampled)
        text = self.output_processor.process(appended)  # stop strings found: decisions for the scheduler
        self.scheduler.apply_text(text)
        if self.draft is not None:  # finished requests give their draft KV back at once
            self.draft.retain({r.request_id for r in self.scheduler.running})
        return self.output_processor.outputs(text)

    def _propose(self) -> None:
        """Proposals for decoding requests that can be speculated (greedy or sampled; guided, penalised or
        min_tokens-constrained ones decode plainly): by the draft model, or by n-gram lookup."""
        k = self.config.num_lookahead_tokens
        todo = []
        for r in self.scheduler.running:
            p = r.params
            r.spec_token_ids, r.spec_draft_probs = [], None
            if p.pooling or not r.can_speculate or r.num_tokens - r.num_computed_tokens != 1:
                continue
            if r.spec_wait > 0:  # backing off after proposals that were all rejected
                r.spec_wait -= 1
                continue
            room = k
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - r.num_output_tokens - 1)
            room = min(room, self.max_model_len - r.num_tokens - 1)
            if room > 0:
                todo.append((r, room))
        if self.draft is not None:
            self.draft.propose(todo)
        else:
            for r, room in todo:
                r.spec_token_ids = propose_ngram(r.all_token_ids, room)

    @property
    def num_spec_proposed(self) -> int:
        return self.scheduler.num_spec_proposed

    @property
    def num_spec_accepted(self) -> int:
        return self.scheduler.num_spec_accepted

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_preempted=sum(1 for r in s.waiting if r.status == RequestStatus.PREEMPTED),
            kv_cache_usage=self.kv.usage,
            num_blocks=self.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            steps=self.steps,
            last_step_time=self.last_step_time,
            spec_decode_num_drafts=self.scheduler.num_spec_drafts,
            spec_decode_num_draft_tokens=self.num_spec_proposed,
            spec_decode_num_accepted_tokens=self.num_spec_accepted,
            block_size=self.block_size,
            cache_dtype=self.kv_dtype_name,
            enable_prefix_caching=self.config.enable_prefix_caching,
            max_lora=self.config.max_loras if self.lora is not None else None,
            running_lora_adapters=_lora_names(s.running),
            waiting_lora_adapters=_lora_names(s.waiting),
            kv_disk=self.kv.disk.stats() if self.kv.disk is not None else None,
        )


def _lora_names(requests) -> tuple[str, ...]:
    """The adapters these requests use, each once, in order (read from another thread: a list changed
    while copied is read again)."""
    for _ in range(5):
        try:
            return tuple(dict.fromkeys(r.lora.name for r in list(requests) if r.lora is not None))
        except RuntimeError:
            continue
    return ()
