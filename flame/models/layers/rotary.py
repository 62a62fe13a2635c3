"""Rotary position embedding, rotate-half (GPT-NeoX) layout as FLA and transformers' Llama use it.

Positions come from ``position_ids`` so that packed documents (varlen) restart at 0.
"""

import torch


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, T, 1, head_dim] in float32 for positions [B, T]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    angles = position_ids.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the angles in cos/sin [B, T, 1, D] (computed in float32, float64 for float64 x)."""
    x_f = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = x_f.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x_f * cos + rotated * sin).to(x.dtype)
