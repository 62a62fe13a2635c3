"""Causal depthwise short convolution over time (the q/k/v "short conv" of DeltaNet / Gated DeltaNet).

`short_conv` runs flame's Triton kernels (triton_kernel.py: forward and backward as torch.library custom ops, so a
compiled block stays one graph) on CUDA tensors and the PyTorch code (reference.py, which defines the semantics)
elsewhere and for widths past the kernel's (flame/ops/dispatch.py). flame's kernels stand in for FLA 0.6.0's
`causal_conv1d`, whose backward runs at ~4.7x the memory-bandwidth floor (docs/performance.md, "Short convolution").
"""

import torch

from flame.ops import dispatch
from flame.ops.short_conv.reference import ACTIVATIONS, as_depthwise_taps, short_conv_torch


def triton_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """flame's Triton kernels, imported on first use: importing them pulls in Triton."""
    from flame.ops.short_conv.triton_kernel import short_conv_triton

    return short_conv_triton(x, weight, bias, activation, cu_seqlens)


def triton_refuses(x, weight, bias, activation, cu_seqlens) -> str | None:
    from flame.ops.short_conv.triton_kernel import MAX_WIDTH

    width = weight.shape[-1]
    return f"takes widths up to {MAX_WIDTH}, not {width}" if width > MAX_WIDTH else None


SHORT_CONV = dispatch.register_op(
    "short_conv",
    short_conv_torch,
    {
        "triton": dispatch.Backend(
            triton_short_conv,
            refuses=triton_refuses,
            requires=("triton",),
            code=("flame.ops.short_conv.triton_kernel.",),
        )
    },
)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv x [B, T, D], weight [D, W] or [D, 1, W], bias [D] -> [B, T, D]."""
    return SHORT_CONV(x, weight, bias, activation, cu_seqlens)


__all__ = ["ACTIVATIONS", "as_depthwise_taps", "short_conv", "short_conv_torch", "triton_short_conv"]
