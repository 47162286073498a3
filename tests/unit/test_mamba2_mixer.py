"""The Mamba-2 mixer (llmserve.model.layers.mamba2) against transformers' own mamba layer (Granite 4.0-H's) with the
same random weights: a sequence run whole, cut into chunks with the state carried, continued by decode steps (batched
over sequences), and through the engine's entry point (the recurrent-state pool's slots), all equal transformers'
output."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf_granite  # noqa: E402

from llmserve.model.attention import StateMetadata  # noqa: E402
from llmserve.model.config import MambaConfig  # noqa: E402
from llmserve.model.layers.mamba2 import Mamba2Mixer, segment_sums  # noqa: E402

ATOL = 1e-5


def _pair(groups: int = 2, chunk: int = 4, conv_bias: bool = True, proj_bias: bool = False):
    """transformers' layer and llmserve's mixer with the same random weights (4 heads of 8, groups of state 6)."""
    hf_cfg = transformers.GraniteMoeHybridConfig(
        hidden_size=16,
        num_attention_heads=2,
        mamba_n_heads=4,
        mamba_n_groups=groups,
        mamba_d_state=6,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=chunk,
        mamba_conv_bias=conv_bias,
        mamba_proj_bias=proj_bias,
        num_hidden_layers=1,
        layer_types=["mamba"],
    )
    torch.manual_seed(0)
    ref = hf_granite.GraniteMoeHybridMambaLayer(hf_cfg, 0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if name != "A_log" else 1.0))
        ref.dt_bias.copy_(torch.randn(4) - 1.0)  # time steps both small and large
    m = MambaConfig(
        heads=4,
        head_dim=8,
        groups=groups,
        state=6,
        conv_kernel=4,
        conv_bias=conv_bias,
        proj_bias=proj_bias,
        chunk_size=chunk,
    )
    mixer = Mamba2Mixer(16, m, hf_cfg.rms_norm_eps).eval()
    missing = mixer.load_state_dict(ref.state_dict(), strict=True)
    assert not missing.missing_keys
    return ref, mixer


def _zero_states(mixer: Mamba2Mixer, batch: int | None = None):
    conv, ssm = mixer.state_shapes()
    lead = () if batch is None else (batch,)
    return torch.zeros(*lead, *conv), torch.zeros(*lead, *ssm)


@torch.no_grad()
@pytest.mark.parametrize("groups,chunk,conv_bias,proj_bias", [(2, 4, True, False), (1, 256, False, True)])
def test_whole_and_chunked_prefill_equal_transformers(groups, chunk, conv_bias, proj_bias):
    ref, mixer = _pair(groups, chunk, conv_bias, proj_bias)
    x = torch.randn(1, 23, 16)
    expected = ref(x)[0]
    whole, conv, ssm = mixer.prefill(x[0], *_zero_states(mixer))
    torch.testing.assert_close(whole, expected, atol=ATOL, rtol=0)
    # cut at uneven points (shorter than the convolution's window too): the states carry it
    out, state = [], _zero_states(mixer)
    for a, b in [(0, 2), (2, 3), (3, 10), (10, 11), (11, 23)]:
        y, *state = mixer.prefill(x[0, a:b], *state)
        out.append(y)
    torch.testing.assert_close(torch.cat(out), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(state[0], conv, atol=ATOL, rtol=0)
    torch.testing.assert_close(state[1], ssm, atol=ATOL, rtol=0)


@torch.no_grad()
def test_decode_steps_continue_prefills_batched():
    """Two sequences of different lengths prefilled apart, then decoded together one token at a time: each row
    equals transformers' output for its whole sequence at that position."""
    ref, mixer = _pair()
    seqs = [torch.randn(1, 14, 16), torch.randn(1, 9, 16)]
    prompts = [7, 3]
    expected = [ref(s)[0] for s in seqs]
    convs, ssms = [], []
    for s, p, e in zip(seqs, prompts, expected):
        y, conv, ssm = mixer.prefill(s[0, :p], *_zero_states(mixer))
        torch.testing.assert_close(y, e[:p], atol=ATOL, rtol=0)
        convs.append(conv)
        ssms.append(ssm)
    conv, ssm = torch.stack(convs), torch.stack(ssms)
    for step in range(6):
        rows = torch.stack([s[0, p + step] for s, p in zip(seqs, prompts)])
        y, conv, ssm = mixer.decode(rows, conv, ssm)
        for i, (e, p) in enumerate(zip(expected, prompts)):
            torch.testing.assert_close(y[i], e[p + step], atol=ATOL, rtol=0)


def _step(seqs: list[tuple[int, int]], pool, fresh: list[bool]) -> StateMetadata:
    """The runner's metadata (engine/state_pool.step_states) for sequences (rows, slot) in batch order, decodes
    (one row) first; fresh slots zeroed, as the runner does."""
    slots = [slot for _, slot in seqs]
    starts = [sum(n for n, _ in seqs[:i]) for i in range(len(seqs))]
    for t in pool:
        t[[s for s, f in zip(slots, fresh) if f]] = 0.0
    return StateMetadata(
        slots=torch.tensor(slots),
        slot_list=slots,
        query_start=starts,
        query_len=[n for n, _ in seqs],
        fresh=torch.tensor(fresh),
        num_decodes=next((i for i, (n, _) in enumerate(seqs) if n > 1), len(seqs)),
    )


@torch.no_grad()
def test_pool_forward_mixes_decode_rows_and_prefill_chunks():
    """The engine's entry point: one flat batch of decode rows (one of them a fresh one-token sequence) and prefill
    chunks (one continuing, one fresh in a slot that held a finished sequence's state), states in the pool's
    tensors (engine/state_pool.py), read and written in place."""
    ref, mixer = _pair()
    pool = _zero_states(mixer, 5)
    pool[0].fill_(7.0)  # (stale values: the fresh slots are zeroed by the runner)
    pool[1].fill_(7.0)
    a, b, c, d, e = (torch.randn(1, n, 16) for n in (10, 8, 3, 4, 7))
    ea, eb, ec, ed, ee = (ref(s)[0] for s in (a, b, c, d, e))
    # step 1: a's first 6 tokens (slot 1), b's first 5 (slot 3), d's 4 (slot 4)
    flat = torch.cat([a[0, :6], b[0, :5], d[0, :4]])
    y = mixer(flat, pool, _step([(6, 1), (5, 3), (4, 4)], pool, [True, True, True]))
    torch.testing.assert_close(y, torch.cat([ea[:6], eb[:5], ed]), atol=ATOL, rtol=0)
    # step 2: decode a (slot 1) and a fresh one-token c (slot 0); b continues 3 tokens; e's first 5 go into slot 4,
    # which held d's state
    flat = torch.cat([a[0, 6:7], c[0, :1], b[0, 5:8], e[0, :5]])
    y = mixer(flat, pool, _step([(1, 1), (1, 0), (3, 3), (5, 4)], pool, [False, True, False, True]))
    torch.testing.assert_close(y, torch.cat([ea[6:7], ec[:1], eb[5:8], ee[:5]]), atol=ATOL, rtol=0)
    # step 3: decode a, c and e together (slots 1, 0, 4)
    flat = torch.cat([a[0, 7:8], c[0, 1:2], e[0, 5:6]])
    y = mixer(flat, pool, _step([(1, 1), (1, 0), (1, 4)], pool, [False, False, False]))
    torch.testing.assert_close(y, torch.cat([ea[7:8], ec[1:2], ee[5:6]]), atol=ATOL, rtol=0)


def test_segment_sums_are_the_sums_of_the_terms_between():
    a = torch.tensor([[0.5, -1.0, 2.0, -0.25]])
    s = segment_sums(a)[0]
    assert s[2, 0].item() == pytest.approx(-1.0 + 2.0)
    assert s[3, 1].item() == pytest.approx(2.0 - 0.25)
    assert s[1, 1].item() == 0.0 and s[0, 3].item() == float("-inf")
