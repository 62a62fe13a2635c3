"""Causal depthwise short convolution over time (the q/k/v "short conv" of DeltaNet / Gated DeltaNet).

`short_conv` runs flame's Triton kernels (triton_kernel.py: forward and backward as torch.library custom ops, so a
compiled block stays one graph) on CUDA tensors and the PyTorch code (reference.py, which defines the semantics)
elsewhere and for widths past the kernel's (flame/ops/dispatch.py). `short_conv_group` convolves several inputs
over one cu_seqlens (a DeltaNet layer's q, k and v): on the kernels, up to MAX_GROUP of them in one launch of each
kernel, which costs the host one op call and one launch where three would cost three (the host bounds a compiled
GatedDeltaNet step without CUDA graphs on some machines: docs/performance.md). flame's kernels stand in for
FLA 0.6.0's `causal_conv1d`, whose backward runs at ~4.7x the memory-bandwidth floor (docs/performance.md, "Short
convolution").
"""

from collections.abc import Sequence

import torch

from flame.ops import dispatch
from flame.ops.short_conv.reference import ACTIVATIONS, MAX_GROUP, as_depthwise_taps, short_conv_torch

Member = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def torch_short_conv(
    x, weight, bias, activation, cu_seqlens, more: Sequence[Member] = ()
) -> list[torch.Tensor]:
    """The PyTorch code for the call's first convolution (x, weight, bias) and each of ``more``."""
    return [short_conv_torch(*member, activation, cu_seqlens) for member in ((x, weight, bias), *more)]


def triton_short_conv(
    x, weight, bias, activation, cu_seqlens, more: Sequence[Member] = ()
) -> list[torch.Tensor]:
    """flame's Triton kernels, imported on first use: importing them pulls in Triton."""
    from flame.ops.short_conv.triton_kernel import short_conv_group_triton

    return short_conv_group_triton([(x, weight, bias), *more], activation, cu_seqlens)


def triton_refuses(x, weight, bias, activation, cu_seqlens, more: Sequence[Member] = ()) -> str | None:
    """The convolutions of one call share their width (``short_conv_group``)."""
    from flame.ops.short_conv.triton_kernel import MAX_WIDTH

    width = weight.shape[-1]
    return f"takes widths up to {MAX_WIDTH}, not {width}" if width > MAX_WIDTH else None


SHORT_CONV = dispatch.register_op(
    "short_conv",
    torch_short_conv,
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
    return SHORT_CONV(x, weight, bias, activation, cu_seqlens)[0]


def _runs_together(x, weight, bias, activation) -> tuple:
    """What convolutions of one call share (the kernels' condition; the PyTorch code takes any)."""
    return (
        x.shape[:2],
        x.dtype,
        x.device,
        weight.dtype,
        weight.shape[-1],
        None if bias is None else bias.dtype,
        activation,
    )


def short_conv_group(
    members: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str | None]],
    cu_seqlens: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """`short_conv(x, weight, bias, activation, cu_seqlens)` for each member (x, weight, bias, activation), in
    order; members of one batch size, length, dtypes, device, width, bias presence and activation go to one call,
    up to MAX_GROUP at a time."""
    outputs: list[torch.Tensor | None] = [None] * len(members)
    calls: list[tuple[tuple, list[int]]] = []  # (what the members share, their indices)
    for index, member in enumerate(members):
        shared = _runs_together(*member)
        call = next((c for c in calls if c[0] == shared and len(c[1]) < MAX_GROUP), None)
        if call is None:
            calls.append((shared, [index]))
        else:
            call[1].append(index)
    for shared, indices in calls:
        first, *more = (members[i][:3] for i in indices)
        for index, y in zip(indices, SHORT_CONV(*first, shared[-1], cu_seqlens, more)):
            outputs[index] = y
    return outputs


__all__ = [
    "ACTIVATIONS",
    "MAX_GROUP",
    "as_depthwise_taps",
    "short_conv",
    "short_conv_group",
    "short_conv_torch",
    "triton_short_conv",
]
