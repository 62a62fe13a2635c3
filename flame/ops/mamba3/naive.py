"""Mamba-3's SISO recurrence one token at a time: the reference the SSD form (flame/ops/mamba3/__init__.py) is
tested against."""

import torch
import torch.nn.functional as F

from flame.ops.mamba3.rotary import cumulative_angles, rotate_pairs


def mamba3_siso_recurrent(
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
    """``mamba3_siso``'s result (same arguments), per head h and token t, with lambda_t = sigmoid(trap_t):

        S_t = exp(adt_t) S_{t-1} + (1 - lambda_t) dt_t exp(adt_t) v_{t-1} k_{t-1}^T + lambda_t dt_t v_t k_t^T
        y_t = (S_t q_t + D v_t) * silu(z_t)

    where q_t, k_t are the biased queries and keys rotated by the cumulative angles, and k_{-1} = v_{-1} = 0."""
    heads = v.shape[2]
    q, k = (t.repeat_interleave(heads // t.shape[2], dim=2) + bias for t, bias in ((q, q_bias), (k, k_bias)))
    theta = cumulative_angles(angles, dt.transpose(1, 2))
    q, k = rotate_pairs(q, theta), rotate_pairs(k, theta)
    weight = torch.sigmoid(trap)
    state = v.new_zeros(v.shape[0], heads, v.shape[-1], k.shape[-1])
    k_previous, v_previous = torch.zeros_like(k[:, 0]), torch.zeros_like(v[:, 0])
    outputs = []
    for t in range(v.shape[1]):
        state = trapezoid_step(
            state, k_previous, v_previous, k[:, t], v[:, t], adt[:, :, t], dt[:, :, t], weight[:, :, t]
        )
        k_previous, v_previous = k[:, t], v[:, t]
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, q[:, t]))
    y = torch.stack(outputs, dim=1)
    if D is not None:
        y = y + D[:, None] * v
    if z is not None:
        y = y * F.silu(z)
    return y, (theta[:, -1], state, k[:, -1], v[:, -1])


def trapezoid_step(state, k_previous, v_previous, k, v, adt, dt, weight):
    """The state after one token by the trapezoidal rule: state [batch, heads, head_dim, state_size], the previous
    token's and this token's rotated keys [batch, heads, state_size] and values [batch, heads, head_dim], adt, dt and
    the trapezoid's weight lambda = sigmoid(trap) [batch, heads]."""
    decay = torch.exp(adt)
    return (
        decay[..., None, None] * state
        + ((1 - weight) * dt * decay)[..., None, None] * v_previous[..., None] * k_previous[..., None, :]
        + (weight * dt)[..., None, None] * v[..., None] * k[..., None, :]
    )
