"""SwiGLU feed-forward block (FLA's GatedMLP)."""

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_intermediate_size(
    hidden_size: int, hidden_ratio: float | None, intermediate_size: int | None
) -> int:
    """FLA's rule: 2/3 * hidden * ratio, rounded up to a multiple of 256, unless given explicitly."""
    if intermediate_size is not None:
        return intermediate_size
    size = int(hidden_size * (hidden_ratio if hidden_ratio is not None else 4) * 2 / 3)
    return 256 * ((size + 255) // 256)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
