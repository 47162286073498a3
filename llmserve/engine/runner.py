"""Batch -> tensors -> model -> logits -> sampled tokens. Owns the model and the KV cache tensors (shaped as the
KV plan says); reads the step's block tables from the scheduler output, never the KV cache manager.

    prepare(sched) -> StepBatch     the step's tensors (what tensor parallelism broadcasts: executor.py)
    forward(batch, argmax)          the model: logits (or greedy tokens) of the rows that sample
    sample(batch, argmax)           forward, then each request's tokens; execute(sched) = sample(prepare(sched))

Rows of the flat batch: decode requests first (one token each), then prefill chunks. Only the last
row of a request that has reached the end of its known tokens yields logits (the others are
mid-prompt chunks whose next token is already known); a request verifying k speculative proposals
yields k + 1.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

import torch

from llmserve.engine import prompt_logprobs
from llmserve.engine.kv_plan import KVPlan
from llmserve.engine.outputs import SampledTokens, SchedulerOutput
from llmserve.engine.pooling import pool
from llmserve.engine.request import Request
from llmserve.engine.state_pool import StatePool, step_states
from llmserve.model import rejection
from llmserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk, kv_cache_shape
from llmserve.model.families.llama import LlamaModel
from llmserve.model.kernels import ops
from llmserve.model.sampler import SamplingRow, _top_logprobs, sample

log = logging.getLogger("llmserve.runner")


def decode_groups(lens: list[int], max_groups: int = 4) -> list[tuple[int, int]]:
    """Split decode rows (sorted by context length) into groups padded to their own longest
    context. Attention reads every padded position, so a short request batched with a long one
    costs as much as the long one; a new group starts where the length has grown by half."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or (len(groups) < max_groups - 1 and i - start >= 4 and lens[i] > 1.5 * lens[start] + 32):
            groups.append((start, i))
            start = i
    return groups


def _zero_pages(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor of zeros backed by its own anonymous mapping (pages are mapped on first write)."""
    import mmap

    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


@dataclass
class StepBatch:
    """One step's inputs, built by `ModelRunner.prepare`: the model's tensors, and which rows mean what."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the rows whose logits are computed
    sampling: list[Request] = field(default_factory=list)  # requests that sample, with their rows each
    rows_per_req: list[int] = field(default_factory=list)
    pooled: list[tuple[Request, int, int, int]] = field(default_factory=list)  # (request, first row, rows, start)
    scored: list[tuple[Request, int, int, int]] = field(default_factory=list)  # prompt logprobs: the same
    lora_rows: list[tuple] = field(default_factory=list)  # requests for a LoRA adapter: (adapter, first row, rows)
    extra: dict = field(default_factory=dict)  # the vision tower's rows: the model's `embeds`


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        plan: KVPlan,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        lora=None,
    ) -> None:
        """The KV tensors of `plan` (kv_plan.py): per attention layer a cache of the main pool's blocks, or of the
        window pool's for a sliding-window layer the plan split off; per recurrent layer its state tensors, one row
        per state slot (engine/state_pool.py). `lora`: LoRALayers (model/lora.py) with --enable-lora."""
        self.model = model
        self.cfg = cfg = model.cfg
        self.block_size = block_size = plan.block_size
        self.device = device
        self.dtype = dtype
        kv_dtype = kv_dtype or dtype
        shape = kv_cache_shape(plan.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        # On CPU each layer's cache is an anonymous mapping: zero pages that become resident only as
        # blocks are written, so memory grows with use up to the budget. (torch.empty is not enough:
        # after large frees malloc recycles old memory, and a NaN bit pattern in a masked-out slot
        # still poisons attention's weighted sum. Stale values in reused blocks are finite.)
        alloc = torch.zeros if device.type == "cuda" else _zero_pages
        nw = plan.window.num_blocks if plan.window is not None else 0
        wshape = kv_cache_shape(nw, block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        window = plan.window_layers if plan.layers else [False] * cfg.num_layers
        states = StatePool(plan.state_slots, plan.state_shapes) if plan.state_slots else None
        self.kv_caches = [
            alloc(wshape if w else shape, dtype=kv_dtype, device=device)
            if states is None or states.shapes[i] is None
            else states.tensors(i, dtype, device)
            for i, w in enumerate(window)
        ]
        self.has_window = plan.window is not None
        self.has_states = states is not None
        self.in_place_decode = (
            device.type == "cpu"
            and dtype == torch.float32
            and ops.cpu_kernels() is not None
            and kv_dtype in ops.KV_DTYPES
        )
        self.lora = lora
        # the last step's final hidden states of pooling requests: (request, first position, [rows, hidden])
        self.pooled: list[tuple[Request, int, torch.Tensor]] = []

    def execute(self, sched: SchedulerOutput, argmax: bool = False) -> list[SampledTokens]:
        return self.sample(self.prepare(sched), argmax)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Block `dst` := block `src` in every layer (never with a window group or recurrent state)."""
        src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def sample(self, batch: StepBatch, argmax: bool = False) -> list[SampledTokens]:
        """Run one step and sample: the tokens of each request that reached the end of its known tokens.
        With `argmax` (the caller has checked that every row is plain greedy), the model answers its
        greedy tokens instead of logits and they are taken as they are."""
        sampling, logits, rows_per_req = self.forward(batch, argmax)
        pooled = [SampledTokens(r, [], pooling=True, embedding=pool(r, h, c)) for r, c, h in self.pooled]
        if not sampling:
            return pooled
        if argmax:
            tokens, out = logits.tolist(), []
            for r, n in zip(sampling, rows_per_req):
                out.append(SampledTokens(r, tokens[:n], None, None))
                tokens = tokens[n:]
        else:
            out = _sample_requests(logits, sampling, rows_per_req)
        return out + pooled

    @torch.inference_mode()
    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        """The step's batch: decodes first, then prefill chunks; each request's blocks from `sched.block_ids`.

        With speculative tokens a request yields several logits rows (one per verified position);
        `rows_per_req` says how many each sampling request has. First the copies on write the step asks for."""
        if sched.block_copies:
            self.copy_blocks(sched.block_copies)
        bs = self.block_size
        # A speculative verify chunk (the next token + K proposals of a decoding request) runs as decode
        # rows with the in-place kernel: row i attends to the first c + i + 1 positions of the request's
        # blocks, which is causal attention over the chunk; small steps then keep the fused decode path.
        spec_rows = self.in_place_decode and bool(sched.num_spec_tokens)

        def as_decode(r) -> bool:
            n = sched.num_scheduled_tokens[r.request_id]
            return n == 1 or spec_rows and sched.num_spec_tokens.get(r.request_id, 0) == n - 1 > 0

        # decodes first, shortest context first (so that similar lengths can share a padded group)
        order = sorted(sched.requests, key=lambda r: (not as_decode(r), r.num_computed_tokens))
        tokens: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logits_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        batch = StepBatch(None, None, None, None)
        image_rows: list[tuple[list[int], torch.Tensor]] = []  # the step's rows at image placeholders, their embeddings
        rope: list[torch.Tensor | None] = []  # multimodal rotary (Request.mrope): each request's [3, n] positions
        row = 0
        for req in order:
            n = sched.num_scheduled_tokens[req.request_id]
            c = req.num_computed_tokens
            block_ids = sched.block_ids[req.request_id]
            spec = sched.num_spec_tokens.get(req.request_id, 0)
            known = req.all_token_ids[c : c + n - spec] + (req.spec_token_ids[:spec] if spec else [])
            tokens.extend(known)
            pos = torch.arange(c, c + n)
            table = torch.tensor(block_ids, dtype=torch.long)
            positions.append(pos)
            rope.append(_mrope_rows(req, c, n))
            slots.append(table[pos // bs] * bs + pos % bs)
            if as_decode(req):
                decode_tables.extend([block_ids] * n)
                decode_lens.extend(range(c + 1, c + n + 1))
            else:
                both = tuple(
                    (im.start, im.end) for im in req.images if im.bidirectional and im.start < c + n and im.end > c
                )
                prefills.append(PrefillChunk(row, n, c + n, table.to(self.device), both))
            if req.lora is not None:
                batch.lora_rows.append((req.lora, row, n))
            if req.images:
                image_rows.extend(_image_rows(self.model, req, c, n, row))
            if k := prompt_logprobs.rows(req, c, n):  # prompt logprobs: the hidden states of its prompt rows
                batch.scored.append((req, row, k, c))
            if req.params.pooling is not None:  # embeddings: every row's hidden state, nothing to sample
                batch.pooled.append((req, row, n, c))
            elif c + n - spec >= req.num_tokens:  # reached the end of the known tokens: sample
                batch.sampling.append(req)
                logits_rows.extend(range(row + n - 1 - spec, row + n))
                batch.rows_per_req.append(spec + 1)
            row += n

        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(dev), prefills=prefills)
        # The in-place decode kernel reads each request's own length: one group. The gather + SDPA
        # path reads every padded position: groups of similar lengths.
        meta.decode_groups = _decode_groups(decode_tables, decode_lens, self.in_place_decode, dev)
        if self.has_window:  # the window layers' blocks: their own slots and tables
            meta.window = self._window_meta(order, sched, as_decode)
        if self.has_states:  # a hybrid model's recurrent layers: each sequence's state slot
            meta.states = step_states(order, sched, dev, self.kv_caches)
        batch.meta = meta
        batch.input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        batch.positions = torch.cat(positions).to(dev)
        if any(r is not None for r in rope):  # a request with images under M-RoPE: [3, T], the others' thrice
            batch.positions = torch.cat([p.expand(3, -1) if r is None else r for p, r in zip(positions, rope)], dim=1)
            batch.positions = batch.positions.to(dev)
        if not logits_rows:
            logits_rows = [len(tokens) - 1]  # the model needs at least one row; it is discarded
        batch.logits_rows = torch.tensor(logits_rows, dtype=torch.long, device=dev)
        if image_rows:  # the vision tower's rows in place of the placeholders' token embeddings
            at = torch.tensor([r for rows, _ in image_rows for r in rows], dtype=torch.long, device=dev)
            batch.extra["embeds"] = (at, torch.cat([e for _, e in image_rows]).to(dev))
        return batch

    @torch.inference_mode()
    def forward(self, batch: StepBatch, argmax: bool = False) -> tuple[list[Request], torch.Tensor | None, list[int]]:
        """Run the model. Returns (requests that sample, their logits [n, vocab], rows per request);
        with `argmax` (every row plain greedy), the rows' greedy tokens [n] instead of the logits."""
        dev = self.device
        if self.lora is not None:  # the step's adapter index, read by the projections' LoRA hooks
            self.lora.set_step(batch.lora_rows, dev)
        self.pooled = []
        args = (batch.input_ids, batch.positions, self.kv_caches, batch.meta, batch.logits_rows)
        if batch.pooled or batch.scored:
            hidden_rows = torch.tensor(
                [r for _, first, n, _ in batch.pooled + batch.scored for r in range(first, first + n)],
                dtype=torch.long,
                device=dev,
            )
            logits, hidden = self.model(*args, argmax=argmax, hidden_indices=hidden_rows, **batch.extra)
            k = 0
            for req, _, n, c in batch.pooled:
                self.pooled.append((req, c, hidden[k : k + n]))
                k += n
            for req, _, n, c in batch.scored:
                prompt_logprobs.record(self.model, req, c, hidden[k : k + n])
                k += n
        else:
            logits = self.model(*args, argmax=argmax, **batch.extra)
        if not batch.sampling:
            return [], None, []
        return batch.sampling, logits, batch.rows_per_req

    def _window_meta(self, order: list[Request], sched: SchedulerOutput, as_decode):
        """The step's attention metadata for the sliding-window layers (kv_window.WindowGroup): each request's
        held blocks from its first one, its positions shifted down by that block's start (a window's mask is
        relative to the query, so the shift changes nothing the layers compute), rows as in the main metadata."""
        bs, dev = self.block_size, self.device
        slots, prefills, tables, lens = [], [], [], []
        row = 0
        for req in order:
            n = sched.num_scheduled_tokens[req.request_id]
            c = req.num_computed_tokens
            first, ids = sched.window_tables[req.request_id]
            off = first * bs
            table = torch.tensor(ids, dtype=torch.long)
            pos = torch.arange(c - off, c + n - off)
            slots.append(table[pos // bs] * bs + pos % bs)
            if as_decode(req):
                tables.extend([ids] * n)
                lens.extend(range(c + 1 - off, c + n + 1 - off))
            else:
                both = tuple(
                    (im.start - off, im.end - off)
                    for im in req.images
                    if im.bidirectional and im.start < c + n and im.end > c
                )
                prefills.append(PrefillChunk(row, n, c + n - off, table.to(dev), both))
            row += n
        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(dev), prefills=prefills)
        meta.decode_groups = _decode_groups(tables, lens, False, dev)
        return meta


def _decode_groups(tables: list[list[int]], lens: list[int], one: bool, dev: torch.device) -> list[DecodeGroup]:
    """Decode rows' padded block tables and context lengths: in one group (`one`), or in groups of similar lengths."""
    out = []
    for start, end in [(0, len(lens))] if lens and one else decode_groups(lens):
        rows = tables[start:end]
        table = torch.zeros(len(rows), max(len(t) for t in rows), dtype=torch.long)
        for i, t in enumerate(rows):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        ctx = torch.tensor(lens[start:end], dtype=torch.long)
        out.append(DecodeGroup(start, end, table.to(dev), ctx.to(dev)))
    return out


def _mrope_rows(req: Request, c: int, n: int) -> torch.Tensor | None:
    """Multimodal rotary positions [3, n] of a request's tokens c..c+n-1: its prompt's from Request.mrope, each
    later token's its index + the offset on all three axes; None without them (the token index is the position)."""
    if req.mrope is None:
        return None
    prompt, delta = req.mrope
    p = prompt.shape[1]
    later = torch.arange(min(max(c, p), c + n), c + n) + delta
    return torch.cat([prompt[:, c : min(c + n, p)], later.expand(3, -1)], dim=1)


def _image_rows(model, req: Request, c: int, n: int, row: int) -> list[tuple[list[int], torch.Tensor]]:
    """A request's image placeholders among its positions c..c+n-1 (its rows from `row`): (the batch rows, their
    embeddings). Each image's tower runs once, the first time a chunk reaches it; its output stays on the request
    for later chunks, a recomputation after preemption, and is sliced wherever a chunk or a cache hit cuts it."""
    out = []
    for im in req.images:
        if im.end <= c or im.start >= c + n:
            continue
        if im.embeds is None:
            im.embeds = model.embed_image(im.data)
            if im.embeds.shape[0] != im.num_tokens:
                raise ValueError(f"the vision tower gave {im.embeds.shape[0]} rows for {im.num_tokens} image tokens")
        lo, hi = bisect.bisect_left(im.positions, c), bisect.bisect_left(im.positions, c + n)
        out.append(([row + p - c for p in im.positions[lo:hi]], im.embeds[lo:hi]))
    return out


def _sample_requests(logits: torch.Tensor, sampling: list[Request], rows_per_req: list[int]) -> list[SampledTokens]:
    """Each request's tokens from its logits rows. A request verifying k proposals has k + 1 rows: greedy
    ones take each row's token (the scheduler keeps those that equal the proposals), sampled ones go
    through rejection sampling (model/rejection.py) over all their rows at once."""
    rows, at, spec = [], [], []  # plain sampling rows and their logits rows; sampled verifications
    i = 0
    for r, n in zip(sampling, rows_per_req):
        p = r.params
        if n > 1 and not p.greedy:
            spec.append((r, i, n))
        else:
            ban = list(r.eos_token_ids) + p.stop_token_ids if r.num_output_tokens < p.min_tokens else []
            rows.extend([SamplingRow(p, r.generator, r.prompt_token_ids, r.output_token_ids, ban, r.guided)] * n)
            at.extend(range(i, i + n))
        i += n
    plain = {}
    if rows:
        results = _sample_isolated(logits if len(at) == len(logits) else logits[at], rows)
        plain = dict(zip(at, results))
    verified = _verify_sampled(logits, spec) if spec else {}
    out, i = [], 0
    for r, n in zip(sampling, rows_per_req):
        if r.request_id in verified:
            out.append(verified[r.request_id])
        else:
            mine = [plain[j] for j in range(i, i + n)]
            ok = next((j for j, res in enumerate(mine) if res[2] is not None), n)  # the rows before a failed one
            error = mine[ok][2] if ok < n else None
            out.append(SampledTokens(r, [res[0] for res in mine[:ok]], [res[1] for res in mine[:ok]], error))
        i += n
    return out


def _verify_sampled(logits: torch.Tensor, spec: list[tuple[Request, int, int]]) -> dict[str, SampledTokens]:
    at = [j for _, i, n in spec for j in range(i, i + n)]
    params = [r.params for r, _, n in spec for _ in range(n)]
    sub = logits[at]
    probs = rejection.target_probs(sub, params)
    out, k = {}, 0
    for r, _, n in spec:
        try:
            q = torch.stack(r.spec_draft_probs[: n - 1]) if r.spec_draft_probs else None  # a draft model's
            tokens = rejection.verify(probs[k : k + n], r.spec_token_ids[: n - 1], r.generator, q)
            lps = [None] * len(tokens)
            if r.params.logprobs is not None:  # the raw distribution's logprobs, as sample() reports them
                rows = [SamplingRow(r.params)] * len(tokens)
                chosen = torch.tensor(tokens, dtype=torch.long, device=sub.device)
                lps = _top_logprobs(torch.log_softmax(sub[k : k + len(tokens)], dim=-1), chosen, rows)
            out[r.request_id] = SampledTokens(r, tokens, lps, None)
        except Exception as e:  # noqa: BLE001 - one request's fault must not stop the others
            out[r.request_id] = SampledTokens(r, [], [], e)
        k += n
    return out


def _sample_isolated(logits: torch.Tensor, rows: list[SamplingRow]) -> list[tuple]:
    """(token, logprobs, None) per row; if sampling the batch fails, rows are sampled one by one so
    that only the faulty ones fail: (None, None, error)."""
    try:
        result = sample(logits, rows)
        return [(t, lp, None) for t, lp in zip(result.token_ids, result.logprobs)]
    except Exception:  # noqa: BLE001
        log.exception("batched sampling failed; retrying row by row")
    out = []
    for i, row in enumerate(rows):
        try:
            one = sample(logits[i : i + 1], [row])
            out.append((one.token_ids[0], one.logprobs[0], None))
        except Exception as e:  # noqa: BLE001
            out.append((None, None, e))
    return out
