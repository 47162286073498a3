"""Speculative decoding with a draft model (--speculative-model): a smaller model of the same tokenizer
proposes k tokens per decoding request, and the target model verifies them in its next batched step
(greedy requests by equality, sampled ones by rejection sampling against the draft's own distributions,
model/rejection.py), so the output is the target's.

The draft has its own weights, KV pool (as many blocks as the target's, without prefix caching) and
runner. It keeps, per request, the tokens whose KV it has computed; before proposing it drops what the
target rejected (the common prefix with the request's tokens is what stays valid) and computes what it
has not seen yet (the prompt on first sight, then the accepted tokens) in the same forward that yields its
first proposal, then k - 1 single-token forwards, all requests batched in each.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from llmserve.engine.executor import make_executor
from llmserve.engine.kv_plan import kv_manager
from llmserve.engine.outputs import SchedulerOutput
from llmserve.engine.request import Request
from llmserve.model import rejection
from llmserve.model.loader import load_model_config, resolve_model
from llmserve.model.loader.mode import weight_mode

log = logging.getLogger("llmserve.draft")


class _Shadow:
    """The draft's view of one request: a Request the draft's runner reads (its tokens are the ones whose KV
    the draft computed or is computing now)."""

    def __init__(self, req: Request) -> None:
        # the draft computes no prompt logprobs (the target does)
        self.req = Request(req.request_id, [], replace(req.params, prompt_logprobs=None))


class DraftProposer:
    def __init__(self, config, target_cfg, device, dtype, act_dtype, kv_dtype, plan):
        """`plan`: the target's KV plan; the draft's pool has as many blocks as the target's budget holds."""
        t0 = time.time()
        self.k = config.num_speculative_tokens
        source = resolve_model(config.speculative_model)
        mc, reader = load_model_config(source)
        if mc.vocab_size != target_cfg.vocab_size:
            raise ValueError(
                f"speculative_model: its vocabulary ({mc.vocab_size} tokens) is not the model's "
                f"({target_cfg.vocab_size}); the draft must share the tokenizer"
            )
        if any(mc.recurrent_layers):  # (its state would have to roll back with each rejected proposal)
            raise ValueError(f"speculative_model: {mc.architecture} is a hybrid model (recurrent state), not a draft")
        asked = "auto" if config.quantization == "gguf" else config.quantization  # (the target's own blocks)
        draft_config = replace(
            config, model=config.speculative_model, tensor_parallel_size=1, enable_lora=False, quantization=asked
        )
        draft_config = weight_mode(draft_config, source, reader, mc, device)
        self.executor = make_executor(draft_config, mc, device)
        positions = (config.max_model_len or target_cfg.max_position_embeddings) + self.k + 1
        self.model = self.executor.load_model(source, reader, dtype, positions, 0)
        del reader
        plan = plan.for_draft(mc.num_layers, self.executor.kv_heads, mc.head_dim)
        self.kv = kv_manager(plan)
        self.runner = self.executor.start(self.model, plan, act_dtype, kv_dtype)
        self.shadows: dict[str, _Shadow] = {}
        log.info(
            "draft model %s: %d layers, proposing %d tokens a step (loaded in %.1f s)",
            source.name,
            mc.num_layers,
            self.k,
            time.time() - t0,
        )

    def propose(self, requests: list[tuple[Request, int]]) -> None:
        """Sets `spec_token_ids` (and for sampled requests `spec_draft_probs`) of each (request, room):
        up to `room` proposals. Requests the draft no longer sees (finished, preempted) are forgotten."""
        self.retain({r.request_id for r, _ in requests})
        batch: list[tuple[Request, _Shadow, int]] = []
        for r, room in requests:
            s = self.shadows.get(r.request_id) or self.shadows.setdefault(r.request_id, _Shadow(r))
            seen = s.req.all_token_ids
            same = next((i for i, (a, b) in enumerate(zip(seen, r.all_token_ids)) if a != b), len(seen))
            valid = min(same, s.req.num_computed_tokens, r.num_tokens - 1)
            s.req.all_token_ids = list(r.all_token_ids)
            s.req.num_computed_tokens = valid
            if self.kv.allocate_slots(s.req, r.num_tokens - valid + room) is None:  # no room in the draft's pool
                self._forget(r.request_id)
                continue
            batch.append((r, s, room))
        if not batch:
            return
        for r, _, _ in batch:
            r.spec_token_ids, r.spec_draft_probs = [], ([] if not r.params.greedy else None)
        for step in range(max(room for _, _, room in batch)):
            active = [(r, s) for r, s, room in batch if room > step]
            self._forward(active)

    @torch.inference_mode()
    def _forward(self, active: list[tuple[Request, _Shadow]]) -> None:
        sched = SchedulerOutput()
        for _, s in active:
            n = s.req.num_tokens - s.req.num_computed_tokens
            sched.num_scheduled_tokens[s.req.request_id] = n
            sched.requests.append(s.req)
        greedy = all(r.params.greedy for r, _ in active)
        self.kv.fill_tables(sched)
        sampling, logits, _ = self.runner.forward(self.runner.prepare(sched), argmax=greedy)
        by_id = {q.request_id: i for i, q in enumerate(sampling)}
        order = [by_id[s.req.request_id] for _, s in active]
        if greedy:
            picked = logits[order].tolist()
        else:
            rows = logits[order]
            probs = rejection.target_probs(rows, [r.params for r, _ in active])
            picked = rows.argmax(dim=-1).tolist()
            for i, (r, _) in enumerate(active):
                if not r.params.greedy:
                    picked[i] = rejection.draw(probs[i], r.generator)
                    r.spec_draft_probs.append(probs[i])
        for (r, s), token in zip(active, picked):
            s.req.num_computed_tokens = s.req.num_tokens
            s.req.all_token_ids.append(token)
            r.spec_token_ids.append(token)

    def retain(self, live: set[str]) -> None:
        """Forget every request but these (and give its draft KV blocks back)."""
        for rid in [rid for rid in self.shadows if rid not in live]:
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        s = self.shadows.pop(request_id, None)
        if s is not None:
            self.kv.free(s.req)

    def shutdown(self) -> None:
        self.executor.shutdown()
