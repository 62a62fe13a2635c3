"""The PyTorch short convolution: the CPU path and the reference of the Triton kernels (triton_kernel.py).

    y[b, t, d] = act( bias[d] + sum_{i=0}^{W-1} weight[d, W-1-i] * x[b, t-i, d] ),

with x[t-i] taken as 0 before the start of the sequence, or of the document when `cu_seqlens` packs several
documents into one row: no token sees a token of the previous document. The last tap weight[:, W-1] multiplies the
current token, as in `nn.Conv1d(D, D, W, groups=D, padding=W-1)` truncated to the first T outputs.

Weights interchange with FLA's `ShortConvolution`: that module is an `nn.Conv1d` subclass whose weight is [D, 1, W]
(its forward squeezes it to the [D, W] that FLA's `causal_conv1d` takes); both shapes are accepted here. The sum
runs in float32 (float64 for float64 inputs) and is cast back to x.dtype, as in FLA's kernel.
"""

import torch
import torch.nn.functional as F

from flame.ops.varlen import position_ids_from_cu_seqlens

ACTIVATIONS = (None, "silu", "swish")
# The convolutions one call of the op takes together (flame.ops.short_conv.short_conv_group): DeltaNet's q, k, v.
MAX_GROUP = 3


def as_depthwise_taps(weight: torch.Tensor) -> torch.Tensor:
    """[D, 1, W] (nn.Conv1d / ShortConvolution layout) or [D, W] -> [D, W]."""
    if weight.ndim == 3:
        if weight.shape[1] != 1:
            raise ValueError(f"a depthwise conv weight must be [D, 1, W], got {tuple(weight.shape)}")
        return weight[:, 0]
    if weight.ndim != 2:
        raise ValueError(f"weight must be [D, W] or [D, 1, W], got {tuple(weight.shape)}")
    return weight


def short_conv_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch causal depthwise conv: x [B, T, D], weight [D, W] or [D, 1, W], bias [D] -> [B, T, D]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    taps = as_depthwise_taps(weight)
    width = taps.shape[1]
    seq_len = x.shape[1]
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    x_f, taps = x.to(compute_dtype), taps.to(compute_dtype)

    if cu_seqlens is None:
        positions = torch.arange(seq_len, device=x.device)
    else:
        if x.shape[0] != 1:
            raise ValueError(f"a packed batch (cu_seqlens given) must have batch size 1, got {x.shape[0]}")
        positions = position_ids_from_cu_seqlens(cu_seqlens).to(x.device)

    # One shifted copy of x per tap; a tap reaching i tokens back is dropped where the token is fewer than i
    # positions into its document (this also covers the zero padding before the sequence start).
    y = x_f * taps[:, width - 1]
    for shift in range(1, min(width, seq_len)):
        x_shifted = F.pad(x_f[:, : seq_len - shift], (0, 0, shift, 0))
        inside_document = (positions >= shift).to(compute_dtype)[None, :, None]
        y = y + x_shifted * inside_document * taps[:, width - 1 - shift]
    if bias is not None:
        y = y + bias.to(compute_dtype)
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype)
