"""RMSNorm and gated RMSNorm as FLA computes them (float32 statistics, output in the input dtype)."""

import torch
from torch import nn

from flame.models.layers.sharding import local_param
from flame.ops.norm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, local_param(self, "weight"), self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * act(gate) over the last dimension: FLA's ``FusedRMSNormGated`` (gate after the norm)."""

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "swish"):
        super().__init__()
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, local_param(self, "weight"), self.eps, self.activation)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
