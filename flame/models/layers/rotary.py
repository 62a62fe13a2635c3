"""Rotary position embedding, rotate-half (GPT-NeoX) layout as FLA and transformers' Llama use it.

Positions come from ``position_ids`` so that packed documents (varlen) restart at 0.

Under torch.compile the cos/sin tables are a custom op (``flame::rotary_cos_sin``), which inductor cannot fuse into
the rotation: fused, the rotation's pointwise kernel computes cos and sin for every head of q and k, and again in
the backward (16x the table's transcendentals at 16 heads; those kernels take 6.4 ms of the transformer's H100 step
in docs/performance.md's speed table profile); as an op the table is computed once per block and the rotation
reads it.
"""

import torch
from torch import Tensor


def _cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    angles = position_ids.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)
    return angles.cos(), angles.sin()


@torch.library.custom_op("flame::rotary_cos_sin", mutates_args=())
def rotary_cos_sin_op(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    return _cos_sin(position_ids, head_dim, theta)


@rotary_cos_sin_op.register_fake
def _(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    shape = (*position_ids.shape, 1, head_dim)
    return position_ids.new_empty(shape, dtype=torch.float32), position_ids.new_empty(
        shape, dtype=torch.float32
    )


def rotary_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin of shape [B, T, 1, head_dim] in float32 for positions [B, T]."""
    if torch.compiler.is_compiling():
        return rotary_cos_sin_op(position_ids, head_dim, float(theta))
    return _cos_sin(position_ids, head_dim, theta)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, T, H, D] by the angles in cos/sin [B, T, 1, D] (computed in float32, float64 for float64 x)."""
    x_f = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = x_f.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x_f * cos + rotated * sin).to(x.dtype)
