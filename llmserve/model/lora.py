"""LoRA adapters (PEFT's format) applied to a LlamaModel's projections, many adapters in one batch.

An adapter is a folder saved by PEFT (`adapter_config.json` + `adapter_model.safetensors`) with low-rank
updates `W + scaling * B @ A` of some of q/k/v/o_proj and gate/up/down_proj. The base weights are never
changed: each step runs the base matmul once for every row, then, per adapter present in the step, the
low-rank update of that adapter's rows (`x[rows] @ A^T @ B^T`, added back into those rows): the grouped
scheme of punica / S-LoRA. Base rows pay nothing but the hook's check. It works the same over float and
quantized (`--quantization`) base layers: the update reads the layer's input and adds to its output.

The model's packed layers (qkv_proj, gate_up_proj: layers.PACKED_PROJECTIONS) hold one adapter matrix
pair each: the parts' A stacked ([sum of ranks, in]) and their B block-diagonal ([out, sum of ranks],
zero where a part has no update), with the scaling folded into B: two matmuls per layer and adapter.

Decode steps with adapter rows run inside the fused C++ decode stack instead (DecodeStack.run_lora, see
`LoRALayers.fused_args`), over a compact copy of each adapter (`_fused_weights`: the packed parts side by
side, not block-diagonal) that the extension wraps once per adapter (`LoRAAdapter.fused_weights`).

    adapter = load_peft_adapter(path, model, max_rank)   # LoRAError (a ValueError) on a bad adapter
    lora = LoRALayers(model)                              # forward hooks on the projections
    lora.set_step([(adapter, first_row, num_rows), ...])  # before each forward (the runner)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from llmserve.model.kernels import ops
from llmserve.model.layers.linear import PACKED_PROJECTIONS
from llmserve.model.layers.rotary import head_order, head_rows

# this model's layers that adapters may target, and where each checkpoint module sits in them
_LAYER_OF = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}
TARGET_MODULES = tuple(_LAYER_OF)
# the fused decode stack's projections of a layer, in its order (llmserve/csrc/decode_stack.cpp, decode_layer)
FUSED_ORDER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# steps with up to this many adapter rows of several adapters run them as one batched matmul pair per layer
BATCHED_ROWS = 64
# adapter rows run through the extension's LoRA kernel: decode steps in the fused C++ decode stack
# (DecodeStack.run_lora) where it takes the step, other steps' hooks one kernel call per projection; False:
# the hooks' torch ops (grouped matmuls) on every step (benchmarks and tests compare the two)
FUSED = True
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """A missing or malformed adapter, or one this model or these limits cannot take."""


@dataclass(eq=False)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    adapter_id: int  # unique per load: the prefix cache's key (a reloaded name is a new adapter)
    # (layer index, "qkv_proj" | "o_proj" | "gate_up_proj" | "down_proj") -> (A^T [in, R], B^T [R, out] scaled)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # the fused decode stack's copy (float32 CPU adapters only): per layer and FUSED_ORDER projection, A^T
    # [in, parts * rank] and B^T [rank, out] with no block-diagonal zeros (`_fused_weights`); empty where absent
    fused: list[torch.Tensor] | None = None
    _fused_ext: object = None  # the extension's LoRAWeights over `fused`, built on first use

    @property
    def num_bytes(self) -> int:
        tensors = [t for pair in self.weights.values() for t in pair] + list(self.fused or ())
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())

    def fused_weights(self):
        """The extension's LoRAWeights for DecodeStack.run_lora (made once per adapter), or None."""
        if self._fused_ext is None and self.fused is not None:
            self._fused_ext = ops.lora_weights(self.fused) or False
        return self._fused_ext or None


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise LoRAError(f"lora_path: {path!r} is not a directory")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"lora_path: {path!r} has no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"lora_path: cannot read {cfg_path}: {e}") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"lora_path: {cfg_path} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"lora_path: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    for key, why in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save (whole layers)"),
        ("alpha_pattern", "alpha_pattern"),
        ("layers_pattern", None),
    ):
        if why and cfg.get(key):
            raise LoRAError(f"lora_path: {why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"lora_path: bias {cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise LoRAError("lora_path: fan_in_fan_out adapters are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(TARGET_MODULES))
        if unknown:
            raise LoRAError(
                f"lora_path: target modules {unknown} are not in this model (LoRA applies to "
                f"{', '.join(TARGET_MODULES)})"
            )
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"lora_path: bad r ({r!r}) or lora_alpha ({alpha!r}) in adapter_config.json")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        try:
            return load_file(st)
        except Exception as e:  # noqa: BLE001 - any corrupt file is the adapter's fault
            raise LoRAError(f"lora_path: cannot read {st}: {e}") from e
    raise LoRAError(f"lora_path: {path!r} has no adapter_model.safetensors")


def load_peft_adapter(
    path: str,
    model: nn.Module,
    max_rank: int,
    name: str = "",
    adapter_id: int = 0,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter for `model` (a LlamaModel); raise LoRAError if it does not fit."""
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora"))
    mc = model.cfg
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(
                f"lora_path: tensor {key!r} is not a LoRA update of a supported module ({', '.join(TARGET_MODULES)})"
            )
        layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in _LAYER_OF or _LAYER_OF[module][0] != block:
            raise LoRAError(
                f"lora_path: target module {block}.{module} is not in this model (LoRA applies "
                f"to {', '.join(TARGET_MODULES)})"
            )
        if layer >= mc.num_layers:
            raise LoRAError(f"lora_path: tensor {key!r} names layer {layer}; the model has {mc.num_layers}")
        found.setdefault((layer, module), {})[ab] = t
    if not found:
        raise LoRAError(f"lora_path: {path!r} holds no LoRA weights")
    ranks = set()
    parts: dict[tuple[int, str], list[tuple[str, torch.Tensor, torch.Tensor, float]]] = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"lora_path: layers.{layer}.{module} lacks its lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        block, packed = _LAYER_OF[module]
        target = getattr(getattr(model.layers[layer], block), packed)
        width = _part_slices(model, packed)[module] if packed in PACKED_PROJECTIONS else (0, target.out_features)
        r = a.shape[0]
        if (
            a.dim() != 2
            or b.dim() != 2
            or b.shape[1] != r
            or a.shape[1] != target.in_features
            or b.shape[0] != width[1] - width[0]
        ):
            raise LoRAError(
                f"lora_path: layers.{layer}.{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                f"do not fit the model's {target.in_features} -> {width[1] - width[0]}"
            )
        if r > max_rank:
            raise LoRAError(f"lora_path: rank {r} is more than --max-lora-rank {max_rank}")
        if module in ("q_proj", "k_proj") and head_order(mc) is not None:  # (partial rotary: the model's row order)
            b = head_rows(b, head_order(mc), mc.head_dim)
        ranks.add(r)
        scaling = alpha / (r**0.5 if rslora else r)
        if module in ("o_proj", "down_proj"):  # (Granite: the residual multiplier, folded into those layers)
            scaling *= mc.residual_multiplier
        parts.setdefault((layer, packed), []).append((module, a, b, scaling))
    device = device or next(model.parameters()).device
    dtype = dtype or torch.float32
    adapter = LoRAAdapter(name, path, max(ranks), adapter_id)
    for (layer, packed), items in parts.items():
        slices = _part_slices(model, packed) if packed in PACKED_PROJECTIONS else None
        block = _LAYER_OF[items[0][0]][0]
        out = getattr(getattr(model.layers[layer], block), packed).out_features
        total = sum(a.shape[0] for _, a, _, _ in items)
        bt = torch.zeros(total, out, dtype=torch.float32)
        r0 = 0
        for module, a, b, scaling in items:
            c0, c1 = slices[module] if slices else (0, out)
            bt[r0 : r0 + a.shape[0], c0:c1] = b.float().t() * scaling
            r0 += a.shape[0]
        at = torch.cat([a.float() for _, a, _, _ in items]).t()
        adapter.weights[(layer, packed)] = (at.contiguous().to(device, dtype), bt.to(device, dtype))
    if device.type == "cpu" and dtype == torch.float32:
        adapter.fused = _fused_weights(model, parts, -(-adapter.rank // 8) * 8)
    return adapter


def _fused_weights(model: nn.Module, parts: dict, rank: int) -> list[torch.Tensor]:
    """Per layer and FUSED_ORDER projection: A^T [in, P * rank] (part p's A^T in columns p * rank..,
    zero padded: P = the packed parts, 1 for others; `rank` a multiple of 8, the kernel's vector width) and
    B^T [rank, out] (each part's B^T, scaled, in its own output columns; rows past a part's rank zero): the
    packed layers' update without the block-diagonal zeros, what the fused decode stack's LoRA kernel reads.
    Empty tensors where the adapter has no update."""
    out: list[torch.Tensor] = []
    empty = torch.empty(0, 0)
    for layer in range(model.cfg.num_layers):
        for packed in FUSED_ORDER:
            items = parts.get((layer, packed))
            if not items:
                out += [empty, empty]
                continue
            names = PACKED_PROJECTIONS.get(packed, (packed,))
            slices = _part_slices(model, packed) if packed in PACKED_PROJECTIONS else None
            at = torch.zeros(items[0][1].shape[1], len(names) * rank)
            bt = torch.zeros(rank, sum(c1 - c0 for c0, c1 in slices.values()) if slices else items[0][2].shape[0])
            for module, a, b, scaling in items:
                p = names.index(module) if slices else 0
                c0, c1 = slices[module] if slices else (0, bt.shape[1])
                at[:, p * rank : p * rank + a.shape[0]] = a.float().t()
                bt[: a.shape[0], c0:c1] = b.float().t() * scaling
            out += [at, bt]
    return out


def _part_slices(model: nn.Module, packed: str) -> dict[str, tuple[int, int]]:
    """Output columns of each checkpoint module inside one of the model's packed layers."""
    layer = model.layers[0]
    if packed == "qkv_proj":
        q, kv = layer.self_attn.q_size, layer.self_attn.kv_size
        return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    inter = layer.mlp.down_proj.in_features
    return {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}


class LoRALayers:
    """Forward hooks on every projection of a LlamaModel that add the step's adapters' updates to
    their rows. `set_step` names the rows of each adapter before a forward; a step without adapter
    rows costs one check per layer; a decode step with adapter rows runs them in the fused decode stack where
    it can (`fused_args`, read by LlamaModel.lora_step), and through these hooks otherwise."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.spans: list[tuple[LoRAAdapter, int, int]] = []  # (adapter, its rows' span in the gathered rows)
        self.rows: slice | torch.Tensor | None = None  # the step's adapter rows, grouped by adapter
        self.num_rows = 0
        self.batched = None  # few rows of several adapters: (gather index, group size, padding mask)
        self._stack_ids: tuple = ()  # the adapters whose stacked weights _stacks holds (cached across steps)
        self._stacks: dict = {}
        self._segments: list[tuple[LoRAAdapter, int, int]] = []
        self._fused: tuple | None = ()
        attn = model.layers[0].self_attn
        self._heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)  # the qkv_proj parts' widths
        self.handles = []
        for i, layer in enumerate(model.layers):
            for block, name in (
                ("self_attn", "qkv_proj"),
                ("self_attn", "o_proj"),
                ("mlp", "gate_up_proj"),
                ("mlp", "down_proj"),
            ):
                module = getattr(getattr(layer, block), name)
                self.handles.append(module.register_forward_hook(self._hook((i, name))))
        # the step's index is dropped when the forward ends (an unloaded adapter is then held by nothing)
        self.handles.append(model.register_forward_hook(lambda *_: self.set_step([], None)))

    def set_step(self, segments: list[tuple[LoRAAdapter, int, int]], device: torch.device | None) -> None:
        """This step's adapter rows: (adapter, first row, rows) per request with an adapter. The rows of
        all adapters are gathered once per projection, grouped by adapter (`rows`: a slice where they
        are contiguous in the batch, an index otherwise), and each adapter's group is a span of them."""
        by_adapter: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        for adapter, first, n in segments:
            by_adapter.setdefault(id(adapter), (adapter, []))[1].extend(range(first, first + n))
        order: list[int] = []
        spans = []
        for adapter, rows in by_adapter.values():
            spans.append((adapter, len(order), len(order) + len(rows)))
            order.extend(rows)
        self.spans = spans
        if order and order == list(range(order[0], order[0] + len(order))):
            self.rows = slice(order[0], order[0] + len(order))
        else:
            self.rows = torch.tensor(order, dtype=torch.long, device=device) if order else None
        self.num_rows = len(order)
        self._segments = segments
        self._fused = ()  # fused_args() not asked yet this step
        self.model.lora_step = self if spans else None
        self.batched = None
        if len(spans) > 1 and len(order) <= BATCHED_ROWS:
            self._plan_batched(spans, order, device)

    def fused_args(self) -> tuple[list[int], list] | None:
        """This step's adapters for the extension's LoRA kernel (DecodeStack.run_lora on decode steps, the
        hooks' ops.lora_linear_add_ on others): ([adapter index, first row, rows] flattened per request,
        [each adapter's LoRAWeights]), or None where it cannot take them (FUSED off, no extension, an
        adapter not float32 on the CPU): the hooks' torch ops run."""
        if self._fused == ():
            self._fused = None
            weights = [a.fused_weights() for a, _, _ in self.spans] if FUSED else [None]
            if all(w is not None for w in weights):
                slot = {id(a): j for j, (a, _, _) in enumerate(self.spans)}
                segments = [v for a, first, n in self._segments for v in (slot[id(a)], first, n)]
                self._fused = (segments, weights)
        return self._fused

    def _plan_batched(self, spans, order: list[int], device) -> None:
        """Few rows of several adapters (decode steps): each adapter's group padded to the largest and all
        groups run as one batched matmul pair (torch.bmm over the adapters' stacked weights), so a
        projection costs the same few ops whatever the number of adapters. Padding rows are zeroed."""
        g = max(end - start for _, start, end in spans)
        if g * len(spans) > 2 * len(order):
            return  # groups too uneven: the per-adapter loop wastes less
        idx, keep = [], []
        for _, start, end in spans:
            group = order[start:end]
            idx += group + [group[0]] * (g - len(group))
            keep += [1.0] * len(group) + [0.0] * (g - len(group))
        mask = None
        if 0.0 in keep:
            mask = torch.tensor(keep, device=device).view(len(spans), g, 1)
        ids = tuple(a.adapter_id for a, _, _ in spans)
        if ids != self._stack_ids:  # the stacked weights of this set of adapters, built per layer on use
            self._stack_ids, self._stacks = ids, {}
        self.batched = (torch.tensor(idx, dtype=torch.long, device=device), g, mask)

    def _stacked(self, key):
        """([adapters, in, R], [adapters, R, out]) of one layer for the step's adapters (zeros where an
        adapter has no update of it or a lower rank), or None if none has one."""
        if key not in self._stacks:
            ws = [a.weights.get(key) for a, _, _ in self.spans]
            present = [w for w in ws if w is not None]
            if not present:
                self._stacks[key] = None
            else:
                r = max(w[0].shape[1] for w in present)
                at = present[0][0].new_zeros(len(ws), present[0][0].shape[0], r)
                bt = present[0][1].new_zeros(len(ws), r, present[0][1].shape[1])
                for i, w in enumerate(ws):
                    if w is not None:
                        at[i, :, : w[0].shape[1]] = w[0]
                        bt[i, : w[1].shape[0]] = w[1]
                self._stacks[key] = (at, bt)
        return self._stacks[key]

    def _hook(self, key: tuple[int, str]):
        proj = FUSED_ORDER.index(key[1])

        def hook(module, inputs, out):
            if not self.spans:
                return None
            x, rows = inputs[0], self.rows
            fused = self.fused_args()
            if fused is not None and x.dim() == 2 and out.dtype is torch.float32 and out.is_contiguous():
                # the fused stack's kernel, one call for all rows and adapters (prefill steps)
                ops.lora_linear_add_(x, out, *fused, self.model.cfg.num_layers, key[0], proj, self._heads)
                return out
            if self.batched is not None:
                stacked = self._stacked(key)
                if stacked is None:
                    return None
                idx, g, mask = self.batched
                xs = x.index_select(0, idx).view(len(self.spans), g, x.shape[1])
                if mask is not None:
                    xs = xs * mask
                delta = torch.bmm(torch.bmm(xs, stacked[0]), stacked[1])
                out.index_add_(0, idx, delta.view(-1, out.shape[1]))
                return out
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            delta = None
            for adapter, start, end in self.spans:
                w = adapter.weights.get(key)
                if w is None:
                    continue
                if delta is None:  # rows of adapters without this layer add nothing
                    full = all(a.weights.get(key) is not None for a, _, _ in self.spans)
                    delta = (torch.empty if full else torch.zeros)(
                        self.num_rows, out.shape[1], dtype=out.dtype, device=out.device
                    )
                torch.mm(xs[start:end] @ w[0], w[1], out=delta[start:end])
            if delta is None:
                return None
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
            return out

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.set_step([], None)
        self._stack_ids, self._stacks = (), {}
