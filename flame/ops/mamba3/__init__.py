"""Mamba-3's SISO scan (Lahoti et al., "Mamba-3: Improved Sequence Modeling using State Space Principles", ICLR 2026)
on flame.ops.ssd, for FLA's Mamba3 layer where mamba_ssm's kernels are not installed.

The recurrence (naive.py, token by token) discretizes with the trapezoidal rule: a token's state update takes its
own key and value with weight lambda_t dt_t and the previous token's with (1 - lambda_t) dt_t exp(adt_t). Unrolled,
the pair (t, s) with s < t weighs v_s k_s^T by exp(adt_{s+1} + ... + adt_t) c_s, where
c_s = lambda_s dt_s + (1 - lambda_{s+1}) dt_{s+1} (the second term 0 for the last token), and s = t by
lambda_t dt_t alone. That is Mamba-2's scan (flame.ops.ssd: queries q, keys c_s k_s, values v, log decay adt per
token) minus (1 - lambda_{t+1}) dt_{t+1} (q_t . k_t) v_t; on a GPU it runs on FLA's chunked simple-GLA kernel, in
chunked PyTorch elsewhere. The arguments and results follow mamba_ssm's ``mamba3_siso_combined``, whose test
reference (``mamba3_siso_fwd_ref``) computes the same sum as one masked matrix per sequence.
"""

import torch
import torch.nn.functional as F

from flame.ops.mamba3.naive import mamba3_mimo_recurrent, mamba3_siso_recurrent
from flame.ops.mamba3.rotary import cumulative_angles, rotate_halves, rotate_pairs
from flame.ops.ssd import ssd


def mamba3_siso(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    adt: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    q_bias: torch.Tensor,
    k_bias: torch.Tensor,
    angles: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """q, k [batch, T, groups, state] (heads share them in groups of consecutive heads), v [batch, T, heads,
    head_dim], adt = A dt, dt and trap (before its sigmoid) [batch, heads, T], q_bias and k_bias [heads, state],
    angles [batch, T, heads, pairs] (pairs <= state / 2), D [heads], z [batch, T, heads, head_dim] -> y [batch, T,
    heads, head_dim] in v's dtype, and the states after the last token as mamba_ssm returns them: the angles [batch,
    heads, pairs], the scan's state [batch, heads, head_dim, state], the last rotated key [batch, heads, state] and
    value [batch, heads, head_dim]."""
    heads = v.shape[2]
    q, k = (t.repeat_interleave(heads // t.shape[2], dim=2) + bias for t, bias in ((q, q_bias), (k, k_bias)))
    dt, adt = dt.transpose(1, 2), adt.transpose(1, 2)  # [batch, T, heads]
    theta = cumulative_angles(angles, dt)
    q, k = rotate_pairs(q, theta), rotate_pairs(k, theta)
    weight = torch.sigmoid(trap).transpose(1, 2)
    # (1 - lambda_{t+1}) dt_{t+1}: the share of token t's key and value that enters at the next token
    # (1 - sigmoid(a) = sigmoid(-a)).
    handed_on = F.pad(torch.sigmoid(-trap).transpose(1, 2)[:, 1:] * dt[:, 1:], (0, 0, 0, 1))
    keys = k * (weight * dt + handed_on)[..., None].to(k.dtype)
    y, state = ssd(v, None, adt, keys, q)
    y = y - ((q * k).sum(-1) * handed_on)[..., None].to(y.dtype) * v
    if D is not None:
        y = y + D[:, None].to(y.dtype) * v
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y, (theta[:, -1], state, k[:, -1], v[:, -1])


def mamba3_mimo(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    adt: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    q_bias: torch.Tensor,
    k_bias: torch.Tensor,
    angles: torch.Tensor,
    mimo_x: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    mimo_z: torch.Tensor | None = None,
    mimo_o: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Mamba-3's MIMO scan: each token updates the state with ``rank`` key-value pairs and reads it with ``rank``
    queries. q, k [batch, T, rank, groups, state], v [batch, T, heads, head_dim], adt, dt, trap [batch, heads, T],
    q_bias and k_bias [heads, rank, state], angles [batch, T, heads, pairs] (pairs <= state / 2; channel i turns
    with channel i + state / 2), mimo_x, mimo_z, mimo_o [heads, rank, head_dim], D [heads], z [batch, T, heads,
    head_dim] -> y [batch, T, heads, head_dim] (with mimo_o; without it each rank's [batch, T, rank, heads,
    head_dim], for a norm before the contraction), and the states after the last token in the layout of FLA's MIMO
    decoding step: the angles [batch, heads, pairs], the state [batch, heads, head_dim, state], the last rotated
    keys [batch, rank, heads, state] and the last x [batch, heads, head_dim].

    As Mamba-2's scan over rank sub-tokens per token: sub-token (t, r) carries the key c_t k_{t,r}, the value
    v_{t,r} = x_t * mimo_x[r] and the query q_{t,r}; the decay applies at a token's first sub-token. Query (t, r)
    then sees every rank of the earlier tokens as the recurrence does, and of its own token the ranks up to r; the
    ranks after r and the trapezoid's diagonal term are added per token (rank x rank products)."""
    batch, length, rank = q.shape[:3]
    heads = v.shape[2]
    q, k = (
        t.repeat_interleave(heads // t.shape[3], dim=3) + bias.transpose(0, 1)
        for t, bias in ((q, q_bias), (k, k_bias))
    )  # [batch, T, rank, heads, state]
    dt, adt = dt.transpose(1, 2), adt.transpose(1, 2)  # [batch, T, heads]
    theta = cumulative_angles(angles, dt)
    q, k = (rotate_halves(t, theta[:, :, None]) for t in (q, k))
    values = v[:, :, None] * mimo_x.transpose(0, 1)  # [batch, T, rank, heads, head_dim]
    weight = torch.sigmoid(trap).transpose(1, 2)
    handed_on = F.pad(torch.sigmoid(-trap).transpose(1, 2)[:, 1:] * dt[:, 1:], (0, 0, 0, 1))
    scale = (weight * dt + handed_on)[:, :, None, :, None].to(k.dtype)
    decay = F.pad(
        adt[:, :, None], (0, 0, 0, rank - 1)
    )  # [batch, T, rank, heads]: the token's first sub-token
    y, state = ssd(
        values.flatten(1, 2), None, decay.flatten(1, 2), (k * scale).flatten(1, 2), q.flatten(1, 2)
    )
    y = y.unflatten(1, (length, rank))
    # Of its own token, query r has seen the keys of ranks <= r with weight c_t: add ranks > r, remove the diagonal.
    later = torch.ones(rank, rank, dtype=torch.bool, device=q.device).triu(1)
    own = torch.where(later[..., None], (weight * dt)[:, :, None, None], -handed_on[:, :, None, None])
    scores = torch.einsum("btrhn,btahn->btrah", q, k) * own.to(q.dtype)  # own: [batch, T, rank, rank, heads]
    y = y + torch.einsum("btrah,btahp->btrhp", scores, values)
    if D is not None:
        y = y + D[:, None].to(y.dtype) * values
    if z is not None:
        y = y * F.silu(z[:, :, None] * mimo_z.transpose(0, 1))
    if mimo_o is not None:
        y = torch.einsum("btrhp,hrp->bthp", y, mimo_o)
    return y, (theta[:, -1], state, k[:, -1], v[:, -1])


__all__ = ["mamba3_mimo", "mamba3_mimo_recurrent", "mamba3_siso", "mamba3_siso_recurrent"]
