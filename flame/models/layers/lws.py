"""OpenELM's layer-wise scaling (Mehta et al., arXiv 2404.14619): attention heads and FFN width grow with depth.

For layer i of N, with d = hidden_size (OpenELM's definition, apple/corenet ``general_gpt.py``):

    a_i = round(linspace(a_min, a_max, N)[i], 2)      q_dim_i = make_divisible(d * a_i, head_dim * gqa_groups)
    num_heads_i = q_dim_i // head_dim                 num_kv_heads_i = num_heads_i // gqa_groups
    b_i = round(linspace(b_min, b_max, N)[i], 2)      ffn_dim_i = make_divisible(b_i * d, 256)

ffn_dim_i is the SwiGLU intermediate size (OpenELM's FFN is gated). Config spelling, on the transformer args:

    "layer_wise_scaling": {"qkv_multipliers": [0.5, 1.0], "ffn_multipliers": [0.5, 4.0],
                           "head_dim": 64, "gqa_groups": 4}

(OpenELM's presets; gqa_groups = query heads per KV head, 1 for plain multi-head attention).
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

from flame.errors import ModelConfigError

# OpenELM rounds every FFN width to a multiple of this.
FFN_DIVISOR = 256


def make_divisible(value: float, divisor: int) -> int:
    """Round to the nearest multiple of divisor, at least divisor, and never more than 10% below value.

    The MobileNet rule that OpenELM uses (corenet's ``make_divisible`` with min_value = divisor); the 10% clause
    is what moves OpenELM-270M's sixth layer from 12 to 16 query heads.
    """
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def layer_multipliers(bounds: tuple[float, float], num_layers: int) -> list[float]:
    """OpenELM's per-layer multipliers: numpy's linspace, each rounded to 2 decimals by numpy's round."""
    return [round(m, 2) for m in np.linspace(bounds[0], bounds[1], num=num_layers, dtype=float)]


@dataclass(frozen=True)
class LayerDims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


def _bounds(config: dict, key: str) -> tuple[float, float]:
    value = config.get(key)
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0 for m in value)
        or value[0] > value[1]
    ):
        raise ModelConfigError(
            f"layer_wise_scaling.{key} must be [min, max] with 0 < min <= max, got {value!r}"
        )
    return float(value[0]), float(value[1])


def _positive_int(config: dict, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"layer_wise_scaling.{key} must be a positive integer, got {value!r}")
    return value


def _even_positive_int(config: dict, key: str) -> int:
    value = _positive_int(config, key)
    if value % 2:
        raise ModelConfigError(
            f"layer_wise_scaling.{key} must be even (RoPE rotates pairs of dimensions), got {value}"
        )
    return value


@dataclass(frozen=True)
class LayerWiseScaling:
    qkv_multipliers: tuple[float, float]
    ffn_multipliers: tuple[float, float]
    head_dim: int
    gqa_groups: int = 1

    @classmethod
    def from_dict(cls, config: Any) -> "LayerWiseScaling":
        if not isinstance(config, dict):
            raise ModelConfigError(f"layer_wise_scaling must be a dict, got {config!r}")
        unknown = sorted(set(config) - {"qkv_multipliers", "ffn_multipliers", "head_dim", "gqa_groups"})
        if unknown:
            raise ModelConfigError(f"layer_wise_scaling.{unknown[0]} is not a layer-wise scaling option")
        return cls(
            qkv_multipliers=_bounds(config, "qkv_multipliers"),
            ffn_multipliers=_bounds(config, "ffn_multipliers"),
            head_dim=_even_positive_int(config, "head_dim"),
            gqa_groups=_positive_int(config, "gqa_groups", 1),
        )

    def layer_dims(self, layer_id: int, num_layers: int, hidden_size: int) -> LayerDims:
        qkv = layer_multipliers(self.qkv_multipliers, num_layers)[layer_id]
        ffn = layer_multipliers(self.ffn_multipliers, num_layers)[layer_id]
        num_heads = make_divisible(hidden_size * qkv, self.head_dim * self.gqa_groups) // self.head_dim
        return LayerDims(
            num_heads=num_heads,
            num_kv_heads=num_heads // self.gqa_groups,
            head_dim=self.head_dim,
            intermediate_size=make_divisible(ffn * hidden_size, FFN_DIVISOR),
        )
