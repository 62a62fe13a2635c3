"""Massive-activation statistics of the hidden state after each decoder layer (the residual stream a block returns).

Per layer, over every token, channel and sequence seen:

- max |h|: the largest absolute value, with the token position and channel where it occurs (massive activations,
  Sun et al. 2024, sit at a few fixed channels of the first token or of delimiters; softpick removes them);
- kurtosis: Fisher's (excess) kurtosis of the flattened values, m4 / m2^2 - 3 with the population central moments
  m_k = mean((h - mean(h))^k): 0 for a Gaussian, large when a few values dwarf the rest.

The moments are accumulated in float64 across forward passes, shifted by the mean of the layer's first batch so that
the central moments computed from them at the end do not cancel.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


def kurtosis(x: torch.Tensor) -> float:
    """Fisher kurtosis of all the values of x (population moments), computed directly."""
    values = x.double().flatten()
    centered = values - values.mean()
    return float((centered**4).mean() / (centered**2).mean() ** 2 - 3)


@dataclass
class LayerActivations:
    max_abs: float = 0.0
    max_position: int = 0  # token position of max |h| in its sequence
    max_channel: int = 0
    count: int = 0
    shift: float | None = None
    power_sums: list[float] = field(default_factory=lambda: [0.0] * 4)  # sums of (h - shift)^1..4

    def update(self, h: torch.Tensor) -> None:
        """Add a hidden state [B, T, C]."""
        magnitude = h.detach().abs()
        index = int(magnitude.argmax())
        value = float(magnitude.flatten()[index])
        if value > self.max_abs or self.count == 0:
            _, position, channel = torch.unravel_index(torch.tensor(index), magnitude.shape)
            self.max_abs, self.max_position, self.max_channel = value, int(position), int(channel)
        values = h.detach().double().flatten()
        if self.shift is None:
            self.shift = float(values.mean())
        y = values - self.shift
        power = torch.ones_like(y)
        for k in range(4):
            power = power * y
            self.power_sums[k] += float(power.sum())
        self.count += values.numel()

    @property
    def kurtosis(self) -> float:
        """Fisher kurtosis of every value seen (see the module docstring); nan for constant values."""
        e1, e2, e3, e4 = (s / self.count for s in self.power_sums)
        m2 = e2 - e1**2
        m4 = e4 - 4 * e1 * e3 + 6 * e1**2 * e2 - 3 * e1**4
        return m4 / m2**2 - 3 if m2 > 0 else float("nan")


class ActivationStats:
    """Forward hooks on a flame model's decoder layers; ``layers`` maps each layer index to its statistics."""

    def __init__(self):
        self.layers: dict[int, LayerActivations] = {}

    def update(self, layer: int, h: torch.Tensor) -> None:
        self.layers.setdefault(layer, LayerActivations()).update(h)

    @contextlib.contextmanager
    def attached(self, model: nn.Module) -> Iterator["ActivationStats"]:
        handles = [
            block.register_forward_hook(lambda module, args, out, i=int(name): self.update(i, out))
            for name, block in model.layers.items()
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
