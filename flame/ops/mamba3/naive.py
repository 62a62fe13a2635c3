"""Mamba-3's SISO and MIMO recurrences one token at a time: the references the SSD forms (flame/ops/mamba3/__init__.py)
are tested against."""

import torch
import torch.nn.functional as F

from flame.ops.mamba3.rotary import cumulative_angles, rotate_halves, rotate_pairs


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
    token's and this token's rotated keys [batch, heads, (rank,) state_size] and values [batch, heads, (rank,)
    head_dim] (MIMO layers: a rank-r update, summed over the rank), adt, dt and the trapezoid's weight lambda =
    sigmoid(trap) [batch, heads]."""
    decay = torch.exp(adt)
    return (
        decay[..., None, None] * state
        + ((1 - weight) * dt * decay)[..., None, None]
        * torch.einsum("bh...p,bh...n->bhpn", v_previous, k_previous)
        + (weight * dt)[..., None, None] * torch.einsum("bh...p,bh...n->bhpn", v, k)
    )


def mamba3_mimo_recurrent(
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
    """``mamba3_mimo``'s result (same arguments), per head h and token t, with lambda_t = sigmoid(trap_t), the
    values of rank r v_{t,r} = x_t * mimo_x[h, r] and the biased queries and keys of rank r rotated by the
    cumulative angles (channels i and i + state / 2):

        S_t = exp(adt_t) S_{t-1} + (1 - lambda_t) dt_t exp(adt_t) sum_r v_{t-1,r} k_{t-1,r}^T
              + lambda_t dt_t sum_r v_{t,r} k_{t,r}^T
        y_{t,r} = (S_t q_{t,r} + D v_{t,r}) * silu(z_t * mimo_z[h, r]);   y_t = sum_r mimo_o[h, r] y_{t,r}

    (mamba_ssm's test reference ``mamba3_MIMO_step_ref``)."""
    heads = v.shape[2]
    q, k = (
        t.repeat_interleave(heads // t.shape[3], dim=3) + bias.transpose(0, 1)
        for t, bias in ((q, q_bias), (k, k_bias))
    )
    theta = cumulative_angles(angles, dt.transpose(1, 2))
    q, k = (
        rotate_halves(t, theta[:, :, None]).transpose(2, 3) for t in (q, k)
    )  # [batch, T, heads, rank, state]
    values = v[:, :, :, None] * mimo_x  # [batch, T, heads, rank, head_dim]
    weight = torch.sigmoid(trap)
    state = v.new_zeros(v.shape[0], heads, v.shape[-1], k.shape[-1])
    k_previous, v_previous = torch.zeros_like(k[:, 0]), torch.zeros_like(values[:, 0])
    outputs = []
    for t in range(v.shape[1]):
        state = trapezoid_step(
            state, k_previous, v_previous, k[:, t], values[:, t], adt[:, :, t], dt[:, :, t], weight[:, :, t]
        )
        k_previous, v_previous = k[:, t], values[:, t]
        outputs.append(torch.einsum("bhpn,bhrn->bhrp", state, q[:, t]))
    y = torch.stack(outputs, dim=1)  # [batch, T, heads, rank, head_dim]
    if D is not None:
        y = y + D[:, None, None] * values
    if z is not None:
        y = y * F.silu(z[:, :, :, None] * mimo_z)
    y = y.transpose(2, 3) if mimo_o is None else torch.einsum("bthrp,hrp->bthp", y, mimo_o)
    return y, (theta[:, -1], state, k[:, -1].transpose(1, 2), v[:, -1])
