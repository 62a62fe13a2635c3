"""Mamba-3's scan (Lahoti et al., "Mamba-3: Improved Sequence Modeling using State Space Principles", ICLR 2026) on
flame.ops.ssd, for FLA's Mamba3 layer where mamba_ssm's kernels are not installed: SISO layers (rank 1) and MIMO
layers (``mimo_rank`` key-value pairs and queries per token).

The recurrence (naive.py, token by token) discretizes with the trapezoidal rule: a token's state update takes its
own keys and values with weight lambda_t dt_t and the previous token's with (1 - lambda_t) dt_t exp(adt_t).
Unrolled, the pair (t, s) with s < t weighs v_{s,r} k_{s,r}^T by exp(adt_{s+1} + ... + adt_t) c_s, where
c_s = lambda_s dt_s + (1 - lambda_{s+1}) dt_{s+1} (the second term 0 for the last token), and s = t by
lambda_t dt_t alone. That is Mamba-2's scan (flame.ops.ssd: keys c_s k_{s,r}, log decay adt per token) over
``rank`` sub-tokens per token, the decay at a token's first sub-token: query (t, r) then sees every rank of the
earlier tokens, and of its own token the ranks up to r with weight c_t; per token, the ranks after r are added
and (1 - lambda_{t+1}) dt_{t+1} (q_{t,r} . k_{t,a}) v_{t,a} removed (rank x rank products). On a GPU the scan runs
on FLA's chunked simple-GLA kernel, in chunked PyTorch elsewhere. The states follow mamba_ssm's kernels and FLA's
decoding step, whose test references (``mamba3_siso_step_ref``, ``mamba3_MIMO_step_ref``) compute the same
recurrence token by token. Documents packed into one row (``cu_seqlens``) are scanned each alone: the angles' sum
restarts at each document, its last token hands nothing on, and Mamba-2's scan takes the boundaries (in sub-tokens).
"""

import torch
import torch.nn.functional as F

from flame.ops.mamba3.naive import mamba3_scan_recurrent, prepared_inputs
from flame.ops.ssd import ssd


def mamba3_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    adt: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    q_bias: torch.Tensor,
    k_bias: torch.Tensor,
    angles: torch.Tensor,
    mimo_x: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    pairwise: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """q, k [batch, T, rank, groups, state] (heads share them in groups of consecutive heads), v [batch, T, heads,
    head_dim], adt = A dt, dt and trap (before its sigmoid) [batch, heads, T], q_bias and k_bias [heads, rank, state],
    angles [batch, T, heads, pairs] (pairs <= state / 2), mimo_x [heads, rank, head_dim] (the values of rank r are
    x * mimo_x[:, r]; None for rank 1: x), D [heads]; ``pairwise``: channels (2i, 2i + 1) turn together, as SISO
    layers rotate, else (i, i + state / 2), as MIMO layers do -> each rank's output S_t q_{t,r} + D v_{t,r} [batch,
    T, rank, heads, head_dim] in v's dtype, and the states after the last token in the layout of FLA's decoding
    step: the angles [batch, heads, pairs], the scan's state [batch, heads, head_dim, state], the last rotated keys
    [batch, rank, heads, state] and the last x [batch, heads, head_dim]. ``cu_seqlens``: the boundaries of documents
    packed into a row of batch 1, each scanned alone; the states are then each document's, [documents, ...] in
    place of [batch, ...]."""
    batch, length, rank = q.shape[:3]
    q, k, values, theta, own, handed_on = prepared_inputs(
        q, k, v, dt, trap, q_bias, k_bias, angles, mimo_x, pairwise, cu_seqlens
    )
    adt = adt.transpose(1, 2)  # [batch, T, heads]
    decay = F.pad(
        adt[:, :, None], (0, 0, 0, rank - 1)
    )  # [batch, T, rank, heads]: at the token's first sub-token
    keys = k * (own + handed_on)[:, :, None, :, None].to(k.dtype)
    sub_tokens = None if cu_seqlens is None else cu_seqlens * rank
    y, state = ssd(
        values.flatten(1, 2),
        None,
        decay.flatten(1, 2),
        keys.flatten(1, 2),
        q.flatten(1, 2),
        cu_seqlens=sub_tokens,
    )
    y = y.unflatten(1, (length, rank))
    # Of its own token, query r has seen the keys of ranks <= r with weight c_t: add ranks > r, remove the diagonal.
    later = torch.ones(rank, rank, dtype=torch.bool, device=q.device).triu(1)
    weights = torch.where(later[..., None], own[:, :, None, None], -handed_on[:, :, None, None])
    scores = torch.einsum("btrhn,btahn->btrah", q, k) * weights.to(q.dtype)  # [batch, T, rank, rank, heads]
    y = y + torch.einsum("btrah,btahp->btrhp", scores, values)
    if D is not None:
        y = y + D[:, None].to(y.dtype) * values
    if cu_seqlens is None:
        return y, (theta[:, -1], state, k[:, -1], v[:, -1])
    last = cu_seqlens[1:].long() - 1  # each document's last token
    return y, (theta[0, last], state, k[0, last], v[0, last])


__all__ = ["mamba3_scan", "mamba3_scan_recurrent"]
