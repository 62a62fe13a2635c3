"""Mamba-2's state-space recurrence (SSD) one token at a time: the reference the chunked form is tested against."""

import torch


def ssd_recurrent(
    x: torch.Tensor, dt: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """y of the SSD scan, per head h and token t:

        S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T      (S: head_dim x state_size, S_0 = 0)
        y_t = S_t C_t

    x [batch, T, heads, head_dim], dt [batch, T, heads] (after softplus and clamping; None: 1, x and A taken as
    they are), A [heads] (negative; or [batch, T, heads], one per token: A_{t,h} in place of A_h), B and C [batch,
    T, heads, state_size] (already one per head). Returns y and the last state S_T [batch, heads, head_dim,
    state_size], computed in x's dtype."""
    batch, length, heads, head_dim = x.shape
    values, log_decay = scaled_inputs(x, dt, A)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    outputs = []
    for t in range(length):
        decay = torch.exp(log_decay[:, t])[..., None, None]
        state = decay * state + values[:, t, ..., None] * B[:, t, :, None, :]
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(outputs, dim=1), state


def scaled_inputs(
    x: torch.Tensor, dt: torch.Tensor | None, A: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan's values dt x and log decay dt A [batch, T, heads] (x and A as they are where dt is None)."""
    if dt is None:
        return x, A.expand(x.shape[:3])
    return x * dt[..., None], dt * A
