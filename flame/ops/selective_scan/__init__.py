"""Mamba's selective scan (the state-space recurrence of Mamba's first version, naive.py).

`selective_scan` runs flame's Triton kernels (triton_kernel.py) on CUDA tensors and the token-by-token PyTorch code
(naive.py, which defines the semantics) elsewhere (flame/ops/dispatch.py). flame's layer for FLA's Mamba
(flame.models.layers.fla_mamba) calls it where mamba_ssm's kernels are not installed.
"""

import torch

from flame.ops import dispatch
from flame.ops.selective_scan.naive import selective_scan_recurrent


def triton_selective_scan(u, delta, A, B, C, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """flame's Triton kernels, imported on first use: importing them pulls in Triton."""
    from flame.ops.selective_scan.triton_kernel import selective_scan_triton

    return selective_scan_triton(u, delta, A, B, C, cu_seqlens)


SELECTIVE_SCAN = dispatch.register_op(
    "selective_scan",
    selective_scan_recurrent,
    {
        "triton": dispatch.Backend(
            triton_selective_scan, requires=("triton",), code=("flame.ops.selective_scan.triton_kernel.",)
        )
    },
)


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """u, delta [batch, T, D]; A [D, N]; B, C [batch, T, N] -> (y [batch, T, D], the last state [batch, D, N]).
    ``cu_seqlens``: the boundaries of documents packed into a row of batch 1, each scanned from a zero state; the
    states are then each document's last [documents, D, N]."""
    if cu_seqlens is not None and u.shape[0] != 1:
        raise ValueError(
            f"packed documents (cu_seqlens) come in one row (batch 1), not a batch of {u.shape[0]}"
        )
    return SELECTIVE_SCAN(u, delta, A, B, C, cu_seqlens)


__all__ = ["selective_scan", "selective_scan_recurrent", "triton_selective_scan"]
