"""flame's PyTorch chunk_bwd_dqkwg (served to FLA on Hopper) against autograd of the quantities it differentiates.

Per chunk, FLA's kernel returns the gradients of
    L = sum(do * o) + sum(dh * h_next) + sum(dv * (-w h))
with o_t = scale (2^{g_t} q_t h + sum_{s<=t} (q_t.k_s) 2^{g_t-g_s} v_s), h_next = 2^{g_last} h + sum_s 2^{g_last-g_s} k_s v_s^T,
taken with the chunk start states h as independent inputs and g in log2 units (dg is reported per unit of
natural-log decay, i.e. divided by ln 2). Checked in float64 with odd lengths, grouped value heads and varlen.
"""

import math

import pytest
import torch

from flame.ops.gated_delta_rule.dqkwg_reference import _chunk_token_index, chunk_bwd_dqkwg_torch


def loss_of_chunks(q, k, v, w, g, h, do, dh, dv, scale, index, valid, state_v_first):
    """L above, written token by token inside each chunk (slow and plain)."""
    num_heads, num_v_heads = q.shape[2], v.shape[2]
    group = num_v_heads // num_heads
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    qf, kf, vf, wf, gf, dof, dvf = map(flat, (q, k, v, w, g, do, dv))
    total = 0.0
    for c in range(index.shape[0]):
        tokens = index[c][valid[c]]
        for head in range(num_v_heads):
            qk_head = head // group
            hc = h[c, head].transpose(0, 1) if state_v_first else h[c, head]  # [K, V]
            dhc = dh[c, head].transpose(0, 1) if state_v_first else dh[c, head]
            gc = gf[tokens, head]
            qc, kc, vc = qf[tokens, qk_head], kf[tokens, qk_head], vf[tokens, head]
            scores = (qc @ kc.T) * torch.exp2(gc[:, None] - gc[None, :])
            scores = torch.where(torch.ones_like(scores, dtype=torch.bool).tril(), scores, 0.0)
            o = scale * (torch.exp2(gc)[:, None] * (qc @ hc) + scores @ vc)
            h_next = torch.exp2(gc[-1]) * hc + (kc * torch.exp2(gc[-1] - gc)[:, None]).T @ vc
            total = total + (dof[tokens, head] * o).sum() + (dhc * h_next).sum()
            total = total + (dvf[tokens, head] * -(wf[tokens, head] @ hc)).sum()
    return total


@pytest.mark.parametrize(
    ("lengths", "num_heads", "num_v_heads", "state_v_first"),
    [((37, 37), 2, 2, False), ((45,), 1, 3, True), ((19, 40, 5), 2, 4, True)],
)
def test_matches_autograd(lengths, num_heads, num_v_heads, state_v_first):
    torch.manual_seed(0)
    chunk_size, key_dim, value_dim, scale = 16, 6, 5, 0.37
    varlen = len(set(lengths)) > 1 or len(lengths) == 3
    batch, seq_len = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if varlen else None
    index, valid = _chunk_token_index(batch, seq_len, chunk_size, cu_seqlens, torch.device("cpu"))
    num_chunks = index.shape[0]

    f64 = dict(dtype=torch.float64)
    q = torch.randn(batch, seq_len, num_heads, key_dim, **f64, requires_grad=True)
    k = torch.randn(batch, seq_len, num_heads, key_dim, **f64, requires_grad=True)
    v = torch.randn(batch, seq_len, num_v_heads, value_dim, **f64)
    w = torch.randn(batch, seq_len, num_v_heads, key_dim, **f64, requires_grad=True)
    # token-local cumulative log2 decay inside each chunk, as FLA's chunk_local_cumsum produces
    raw = -torch.rand(batch * seq_len, num_v_heads, **f64) / math.log(2)
    g = torch.zeros_like(raw)
    for c in range(num_chunks):
        tokens = index[c][valid[c]]
        g[tokens] = raw[tokens].cumsum(0)
    g = g.view(batch, seq_len, num_v_heads).requires_grad_()
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    h = torch.randn(num_chunks, num_v_heads, *state_shape, **f64)
    dh = torch.randn_like(h)
    do = torch.randn(batch, seq_len, num_v_heads, value_dim, **f64)
    dv = torch.randn_like(do)

    loss = loss_of_chunks(q, k, v, w, g, h, do, dh, dv, scale, index, valid, state_v_first)
    expected = torch.autograd.grad(loss, (q, k, w, g))
    dq, dk, dw, dg = chunk_bwd_dqkwg_torch(
        q.detach(), k.detach(), v, do, h.unsqueeze(0), dh.unsqueeze(0), w=w.detach(), g=g.detach(), dv=dv,
        scale=scale, state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
    )  # fmt: skip
    tolerance = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dq.double(), expected[0], **tolerance)
    torch.testing.assert_close(dk.double(), expected[1], **tolerance)
    torch.testing.assert_close(dw.double(), expected[2], **tolerance)
    # the kernel's dg is per natural-log unit of decay: d/dg of 2^g is ln2 * 2^g
    torch.testing.assert_close(dg.double(), expected[3] / math.log(2), **tolerance)


def test_refuses_ungated_case():
    x = torch.zeros(1, 4, 1, 2)
    with pytest.raises(ValueError, match="gated case only"):
        chunk_bwd_dqkwg_torch(x, x, x, x, torch.zeros(1, 1, 1, 2, 2), torch.zeros(1, 1, 1, 2, 2))
