"""Mamba-2's state-space recurrence (SSD) one token at a time: the reference the chunked form is tested against."""

import torch


def ssd_recurrent(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """y of the SSD scan, per head h and token t:

        S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T      (S: head_dim x state_size, S_0 = 0)
        y_t = S_t C_t

    x [batch, T, heads, head_dim], dt [batch, T, heads] (after softplus and clamping), A [heads] (negative; or
    [batch, T, heads], one per token: A_{t,h} in place of A_h), B and C [batch, T, heads, state_size] (already one
    per head). Returns y and the last state S_T [batch, heads, head_dim, state_size], computed in x's dtype."""
    batch, length, heads, head_dim = x.shape
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    outputs = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * (A[:, t] if A.dim() == 3 else A))[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(outputs, dim=1), state
