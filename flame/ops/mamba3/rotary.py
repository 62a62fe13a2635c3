"""Mamba-3's data-dependent rotary angles: the complex-valued state of the paper written as rotations of the queries
and keys (Lahoti et al., "Mamba-3: Improved Sequence Modeling using State Space Principles", ICLR 2026)."""

import math

import torch
import torch.nn.functional as F


def cumulative_angles(
    angles: torch.Tensor,
    dt: torch.Tensor,
    start: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """angles [batch, T, heads, pairs] (the layer's projection, before the bound) and dt [batch, T, heads] -> the
    angle of each token, ``start`` (the angles before the first token, [batch, heads, pairs]; default 0) plus the
    sum over s <= t of dt_s pi tanh(angles_s), in [0, 2 pi) as mamba_ssm keeps it (float32 at least: the sum grows
    with the sequence); with ``cu_seqlens`` (documents packed into a row) the sum over the tokens s <= t of t's own
    document."""
    dtype = torch.promote_types(angles.dtype, torch.float32)
    total = torch.cumsum(torch.tanh(angles.to(dtype)) * math.pi * dt.to(dtype)[..., None], dim=1)
    if cu_seqlens is not None:
        before = F.pad(total, (0, 0, 0, 0, 1, 0))  # before[:, s]: the sum over the tokens before s
        total = total - before[:, cu_seqlens.long()[document_of_each_token(cu_seqlens, total.shape[1])]]
    if start is not None:
        total = total + start[:, None]
    return total - 2 * math.pi * torch.floor(total / (2 * math.pi))


def rotate_pairs(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """x [..., width] with channels (2i, 2i + 1) rotated by theta[..., i] for i < theta's last size; the channels
    past twice that are left as they are."""
    rotated = 2 * theta.shape[-1]
    pairs = torch.unflatten(x[..., :rotated], -1, (-1, 2))
    first, second = pairs[..., 0], pairs[..., 1]
    cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
    turned = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)
    return torch.cat((turned, x[..., rotated:]), dim=-1)


def rotate_halves(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """x [..., width] with channels (i, i + width / 2) rotated by theta[..., i] for i < theta's last size (the
    pairing of mamba_ssm's Mamba-3 MIMO kernels and of FLA's MIMO decoding step); the other channels are left as
    they are."""
    half, count = x.shape[-1] // 2, theta.shape[-1]
    first, second = x[..., :count], x[..., half : half + count]
    cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
    return torch.cat(
        (first * cos - second * sin, x[..., count:half], first * sin + second * cos, x[..., half + count :]),
        dim=-1,
    )


def document_of_each_token(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """The index of each token's document [length], from the documents' boundaries (on their device, no sync)."""
    positions = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)
