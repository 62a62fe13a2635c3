"""Mamba's selective scan (Gu and Dao, 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
algorithm 2), token by token: the reference flame's kernel is tested against, and the path on devices without it.

Per channel d and state n, with a negative A[d, n] and an input-dependent step delta[t, d] > 0:

    h[t, d, n] = exp(delta[t, d] A[d, n]) h[t - 1, d, n] + delta[t, d] B[t, n] u[t, d],   h[-1] = 0
    y[t, d]    = sum_n C[t, n] h[t, d, n]

(Mamba's D skip and gate are applied by the layer.) Every product is formed in float32 (float64 for float64
inputs); memory is one state per row, not one per token.
"""

import torch


def selective_scan_recurrent(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """u, delta [batch, T, D]; A [D, N]; B, C [batch, T, N] -> (y [batch, T, D] in u's dtype, the state after the
    last token [batch, D, N] in the compute dtype). ``cu_seqlens``: the boundaries of documents packed into a row
    of batch 1, each scanned from a zero state; the states are then each document's last [documents, D, N]."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        scans = [
            selective_scan_recurrent(
                *(t[:, start:end] for t in (u, delta)), A, *(t[:, start:end] for t in (B, C))
            )
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat([y for y, _ in scans], dim=1), torch.cat([state for _, state in scans])
    dtype = u.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    u, delta, A, B, C = (t.to(compute) for t in (u, delta, A, B, C))
    state = u.new_zeros(u.shape[0], u.shape[2], A.shape[1])
    ys = []
    for t in range(u.shape[1]):
        step = delta[:, t, :, None]
        state = torch.exp(step * A) * state + step * B[:, t, None, :] * u[:, t, :, None]
        ys.append(torch.einsum("bdn,bn->bd", state, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else u.new_zeros(u.shape)
    return y.to(dtype), state
