"""Mamba-3's recurrence one token at a time, SISO or MIMO: the reference the SSD form (flame/ops/mamba3/__init__.py)
is tested against."""

import torch
import torch.nn.functional as F

from flame.ops.mamba3.rotary import cumulative_angles, rotate_halves, rotate_pairs


def prepared_inputs(q, k, v, dt, trap, q_bias, k_bias, angles, mimo_x, pairwise, cu_seqlens=None):
    """What the scan reads, per token, from ``mamba3_scan``'s arguments: the biased queries and keys, one per head,
    rotated by the cumulative angles [batch, T, rank, heads, state], the values [batch, T, rank, heads, head_dim],
    the angles [batch, T, heads, pairs], and the trapezoid's weights [batch, T, heads]: lambda_t dt_t for the
    token's own keys and (1 - lambda_{t+1}) dt_{t+1} for what it hands on to the next token (0 for the last, and
    with ``cu_seqlens`` for each document's last)."""
    heads = v.shape[2]
    dt = dt.transpose(1, 2)  # [batch, T, heads]
    theta = cumulative_angles(angles, dt, cu_seqlens=cu_seqlens)
    rotate = rotate_pairs if pairwise else rotate_halves
    q, k = (
        rotate(t.repeat_interleave(heads // t.shape[3], dim=3) + bias.transpose(0, 1), theta[:, :, None])
        for t, bias in ((q, q_bias), (k, k_bias))
    )
    values = v[:, :, None] if mimo_x is None else v[:, :, None] * mimo_x.transpose(0, 1)
    own = torch.sigmoid(trap).transpose(1, 2) * dt
    # 1 - sigmoid(a) = sigmoid(-a)
    handed_on = F.pad(torch.sigmoid(-trap).transpose(1, 2)[:, 1:] * dt[:, 1:], (0, 0, 0, 1))
    if cu_seqlens is not None:
        handed_on = handed_on.index_fill(1, cu_seqlens[1:].long() - 1, 0)
    return q, k, values, theta, own, handed_on


def mamba3_scan_recurrent(
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
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``mamba3_scan``'s result (same arguments), per head h and token t, with lambda_t = sigmoid(trap_t), the
    values of rank r v_{t,r} = x_t * mimo_x[h, r] (x_t for rank 1 without mimo_x) and q_{t,r}, k_{t,r} the biased
    queries and keys rotated by the cumulative angles:

        S_t = exp(adt_t) S_{t-1} + (1 - lambda_t) dt_t exp(adt_t) sum_r v_{t-1,r} k_{t-1,r}^T
              + lambda_t dt_t sum_r v_{t,r} k_{t,r}^T,        k_{-1} = v_{-1} = 0
        y_{t,r} = S_t q_{t,r} + D v_{t,r}"""
    q, k, values, theta, _, _ = prepared_inputs(q, k, v, dt, trap, q_bias, k_bias, angles, mimo_x, pairwise)
    dt, weight = dt.transpose(1, 2), torch.sigmoid(trap).transpose(1, 2)  # [batch, T, heads]
    state = v.new_zeros(v.shape[0], v.shape[2], v.shape[-1], k.shape[-1])
    k_previous, v_previous = torch.zeros_like(k[:, 0]), torch.zeros_like(values[:, 0])
    outputs = []
    for t in range(v.shape[1]):
        state = trapezoid_step(
            state, k_previous, v_previous, k[:, t], values[:, t], adt[:, :, t], dt[:, t], weight[:, t]
        )
        k_previous, v_previous = k[:, t], values[:, t]
        outputs.append(torch.einsum("bhpn,brhn->brhp", state, q[:, t]))
    y = torch.stack(outputs, dim=1)  # [batch, T, rank, heads, head_dim]
    if D is not None:
        y = y + D[:, None] * values
    return y, (theta[:, -1], state, k[:, -1], v[:, -1])


def trapezoid_step(state, k_previous, v_previous, k, v, adt, dt, weight):
    """The state after one token by the trapezoidal rule: state [batch, heads, head_dim, state_size], the previous
    token's and this token's rotated keys [batch, rank, heads, state_size] and values [batch, rank, heads,
    head_dim] (a rank-r update, summed over the rank), adt, dt and the trapezoid's weight lambda = sigmoid(trap)
    [batch, heads]."""
    decay = torch.exp(adt)
    return (
        decay[..., None, None] * state
        + ((1 - weight) * dt * decay)[..., None, None]
        * torch.einsum("brhp,brhn->bhpn", v_previous, k_previous)
        + (weight * dt)[..., None, None] * torch.einsum("brhp,brhn->bhpn", v, k)
    )
