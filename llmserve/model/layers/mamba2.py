"""The Mamba-2 mixer (Granite 4.0-H's recurrent layers), as llmserve layers, in float32 PyTorch.

One projection (`in_proj`) gives each token a gate z (the inner width), the values x with B and C (the
convolved channels) and a time step per head. x, B and C go through a depthwise causal convolution
(`conv_kernel` wide, SiLU after it); then the selective state-space scan, per head h with a state S_h of
[head_dim, state] values:

    dt = clamp(softplus(dt + dt_bias)),  A = -exp(A_log)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T      y_t = S_t C_t + D x_t

(B and C shared by the heads of a group); y times SiLU(z), RMS-normed per group (the gated norm), then
`out_proj`. A sequence's state between steps is its convolution window (the last conv_kernel - 1 inputs of the
convolution, [conv_dim, conv_kernel - 1]) and its scan state ([heads, head_dim, state]): `state_shapes`.

Two entry points:
- `prefill`: a chunk of T tokens of one sequence from its (conv, ssm) states, returning the updated states. The scan
  runs chunk by chunk (`chunk_size` tokens: the chunked "state space duality" form, a few matmuls per chunk: within
  a chunk the outputs are a masked, decayed C B^T product applied to dt x, plus the entering state read by C; the
  state leaving it is the entering one decayed plus the chunk's decayed dt x B^T). The decays are exponentials of
  segment sums of dt A, summed within the chunk from the masked rows themselves (no difference of two long
  cumulative sums, which loses precision).
- `decode`: one token of each of several sequences, their states stacked ([batch, ...]): the recurrence above as one
  set of tensor ops for the whole batch.
Both compute in float32 whatever the activations' dtype. `forward` runs a flat engine batch (decode rows, then
prefill chunks) against the engine's recurrent-state pool (engine/state_pool.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmserve.model.attention import StateMetadata
from llmserve.model.config import MambaConfig
from llmserve.model.layers.cache_kinds import RecurrentState
from llmserve.model.layers.linear import Linear


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * SiLU(z) over each of `groups` equal parts of the row (Mamba-2's norm, gate first)."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(y.dtype)


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: entry (t, s) is a[s + 1] + ... + a[t] for s <= t (0 on the diagonal), -inf above it.
    Summed from the masked rows, so each entry is exact to its own terms' rounding."""
    n = a.shape[-1]
    keep = torch.ones(n, n, dtype=torch.bool, device=a.device)
    terms = a.unsqueeze(-1).expand(*a.shape, n).masked_fill(~keep.tril(-1), 0.0)  # (k, s): a[k] where k > s
    return terms.cumsum(-2).masked_fill(~keep.tril(), float("-inf"))


def ssd_scan(x, dt, A, B, C, state, chunk: int):
    """The scan over one sequence, chunk by chunk. x [T, h, p], dt [T, h] (after softplus), A [h], B / C [T, h, n]
    (per head), state [h, p, n] (the entering one). Returns (y [T, h, p] without the D term, the leaving state)."""
    ys = []
    for s in range(0, x.shape[0], chunk):
        xc, dtc = x[s : s + chunk], dt[s : s + chunk]
        Bc, Cc = B[s : s + chunk].transpose(0, 1), C[s : s + chunk].transpose(0, 1)  # [h, L, n]
        a = (dtc * A).t()  # [h, L]
        cum = a.cumsum(-1)
        xdt = (xc * dtc.unsqueeze(-1)).transpose(0, 1)  # [h, L, p]
        mixed = (Cc @ Bc.transpose(1, 2)) * segment_sums(a).exp()  # [h, L(t), L(s)]
        y = mixed @ xdt + (Cc @ state.transpose(1, 2)) * cum.exp().unsqueeze(-1)
        leave = (cum[:, -1:] - cum).exp()  # [h, L]: each position's decay to the chunk's end
        state = state * cum[:, -1].exp()[:, None, None] + (xdt * leave.unsqueeze(-1)).transpose(1, 2) @ Bc
        ys.append(y.transpose(0, 1))
    return torch.cat(ys), state


def ssd_step(x, dt, A, B, C, state):
    """One token of each of a batch of sequences: x [b, h, p], dt [b, h], B / C [b, h, n], state [b, h, p, n].
    Returns (y [b, h, p] without the D term, the new states)."""
    state = state * torch.exp(dt * A)[..., None, None] + (x * dt.unsqueeze(-1)).unsqueeze(-1) * B.unsqueeze(-2)
    return (state @ C.unsqueeze(-1)).squeeze(-1), state


class Mamba2Mixer(nn.Module):
    """Mamba-2's mixer with transformers' parameter names (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""

    def __init__(self, hidden_size: int, m: MambaConfig, eps: float) -> None:
        super().__init__()
        self.m = m
        self.in_proj = Linear(hidden_size, m.inner + m.conv_dim + m.heads, bias=m.proj_bias)
        # (its weight and bias only: the convolution runs against each sequence's window, see _conv / _conv_step)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, m.conv_kernel, groups=m.conv_dim, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(m.heads))
        self.A_log = nn.Parameter(torch.zeros(m.heads))
        self.D = nn.Parameter(torch.ones(m.heads))
        self.norm = GatedRMSNorm(m.inner, m.groups, eps)
        self.out_proj = Linear(m.inner, hidden_size, bias=m.proj_bias)
        self.all_reduce = None  # (tensor parallelism is refused for hybrid models)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One sequence's (convolution window, scan state) shapes; both are kept in float32."""
        m = self.m
        return (m.conv_dim, m.conv_kernel - 1), (m.heads, m.head_dim, m.state)

    def cache_kind(self, state_dtype: torch.dtype) -> RecurrentState:
        return RecurrentState(self.state_shapes(), state_dtype)

    # -- the pieces ------------------------------------------------------------------------------------
    def _split(self, zxbcdt: torch.Tensor):
        m = self.m
        return zxbcdt.split([m.inner, m.conv_dim, m.heads], dim=-1)

    def _time_steps(self, dt: torch.Tensor) -> torch.Tensor:
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(self.m.dt_min, self.m.dt_max)

    def _heads(self, xbc: torch.Tensor):
        """Convolved channels [..., conv_dim] -> x [..., h, p], B and C [..., h, n] (each group's for its heads)."""
        m = self.m
        x, B, C = xbc.split([m.inner, m.groups * m.state, m.groups * m.state], dim=-1)
        lead, rep = x.shape[:-1], m.heads // m.groups
        B = B.reshape(*lead, m.groups, m.state).repeat_interleave(rep, dim=-2)
        C = C.reshape(*lead, m.groups, m.state).repeat_interleave(rep, dim=-2)
        return x.reshape(*lead, m.heads, m.head_dim), B, C

    def _conv(self, xbc: torch.Tensor, window: torch.Tensor):
        """Causal depthwise convolution of one sequence's xbc [T, c] after its window [c, K - 1]: (SiLU of the
        output [T, c], the new window)."""
        seq = torch.cat([window, xbc.t()], dim=1)
        w, b = self.conv1d.weight.float(), self.conv1d.bias
        out = F.conv1d(seq.unsqueeze(0), w, None if b is None else b.float(), groups=seq.shape[0])[0]
        return F.silu(out.t()), seq[:, seq.shape[1] - window.shape[1] :]

    def _conv_step(self, xbc: torch.Tensor, windows: torch.Tensor):
        """One token of each sequence: xbc [b, c], windows [b, c, K - 1]."""
        full = torch.cat([windows, xbc.unsqueeze(-1)], dim=-1)
        out = (full * self.conv1d.weight.float()[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias.float()
        return F.silu(out), full[:, :, 1:]

    def _prefill_core(self, xbc, dt, conv_state, ssm_state):
        """One sequence's scan over T tokens (in_proj's xbc [T, c] and dt [T, h]): (y [T, inner], states)."""
        xbc, conv_state = self._conv(xbc.float(), conv_state.float())
        x, B, C = self._heads(xbc)
        A = -torch.exp(self.A_log.float())
        y, ssm_state = ssd_scan(x, self._time_steps(dt), A, B, C, ssm_state.float(), self.m.chunk_size)
        y = y + x * self.D.float().unsqueeze(-1)
        return y.reshape(y.shape[0], -1), conv_state, ssm_state

    def _decode_core(self, xbc, dt, conv_states, ssm_states):
        """One token of each of b sequences (xbc [b, c], dt [b, h]): (y [b, inner], states)."""
        xbc, conv_states = self._conv_step(xbc.float(), conv_states.float())
        x, B, C = self._heads(xbc)
        A = -torch.exp(self.A_log.float())
        y, ssm_states = ssd_step(x, self._time_steps(dt), A, B, C, ssm_states.float())
        y = y + x * self.D.float().unsqueeze(-1)
        return y.reshape(y.shape[0], -1), conv_states, ssm_states

    def _out(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        o = self.out_proj(self.norm(y, z).to(dtype))
        return o if self.all_reduce is None else self.all_reduce(o)

    # -- entry points ------------------------------------------------------------------------------------
    def prefill(self, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """T tokens of one sequence (h [T, hidden]) from its states: (output [T, hidden], conv state, ssm state)."""
        z, xbc, dt = self._split(self.in_proj(h))
        y, conv_state, ssm_state = self._prefill_core(xbc, dt, conv_state, ssm_state)
        return self._out(y, z, h.dtype), conv_state, ssm_state

    def decode(self, h: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor):
        """One token of each of b sequences (h [b, hidden], states stacked [b, ...]): (output [b, hidden], states)."""
        z, xbc, dt = self._split(self.in_proj(h))
        y, conv_states, ssm_states = self._decode_core(xbc, dt, conv_states, ssm_states)
        return self._out(y, z, h.dtype), conv_states, ssm_states

    def forward(self, h: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], meta: StateMetadata):
        """A flat engine batch (decode rows first, then prefill chunks, as `meta` says: engine/state_pool.py) against
        the pool's state tensors (conv [slots, conv_dim, K - 1], ssm [slots, h, p, n]), read and written back in
        place. Fresh sequences' slots were zeroed by the runner."""
        conv_pool, ssm_pool = states
        z, xbc, dt = self._split(self.in_proj(h))
        y = torch.empty(h.shape[0], self.m.inner, dtype=torch.float32, device=h.device)
        b = meta.num_decodes
        if b:  # (rows 0 .. b - 1, one per sequence)
            slots = meta.slots[:b]
            conv, ssm = conv_pool.index_select(0, slots), ssm_pool.index_select(0, slots)
            y[:b], conv, ssm = self._decode_core(xbc[:b], dt[:b], conv, ssm)
            conv_pool.index_copy_(0, slots, conv.to(conv_pool.dtype))
            ssm_pool.index_copy_(0, slots, ssm.to(ssm_pool.dtype))
        for i in range(b, len(meta.slot_list)):
            slot, rows = meta.slot_list[i], slice(meta.query_start[i], meta.query_start[i] + meta.query_len[i])
            y[rows], conv, ssm = self._prefill_core(xbc[rows], dt[rows], conv_pool[slot], ssm_pool[slot])
            conv_pool[slot], ssm_pool[slot] = conv, ssm
        return self._out(y, z, h.dtype)
