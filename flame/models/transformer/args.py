"""Arguments of the transformer family; fields and defaults follow FLA 0.6.0's TransformerConfig.

Two flame extensions (FLA's config class stores unknown keys and ignores them):

- ``window_pattern``: per-layer sliding windows, layer i uses ``window_pattern[i % len(window_pattern)]``, null
  meaning full attention. OLMo's control is ``[4097, 4097, 4097, null]``. Excludes ``window_size``.
- ``layer_wise_scaling``: OpenELM's per-layer head counts and FFN widths (see flame.models.layers.lws); with it,
  ``num_heads`` and ``hidden_ratio`` are not used, and ``num_kv_heads`` / ``intermediate_size`` must stay unset.
"""

from dataclasses import dataclass
from typing import ClassVar

from flame.errors import ModelConfigError
from flame.models.common.args import ModelArgs, require_divisible
from flame.models.common.choices import check_attn_impl, swiglu_intermediate_size
from flame.models.layers.lws import LayerDims, LayerWiseScaling


@dataclass
class TransformerArgs(ModelArgs):
    model_type: ClassVar[str] = "transformer"

    num_heads: int = 32
    num_kv_heads: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    window_size: int | None = None
    rope_theta: float = 10000.0
    attn_impl: str = "parallel_attn"
    window_pattern: list[int | None] | None = None
    layer_wise_scaling: dict | None = None

    def validate(self) -> None:
        super().validate()
        check_attn_impl(self.attn_impl)
        if self.layer_wise_scaling is None:
            require_divisible(self.hidden_size, self.num_heads, "hidden_size must be divisible by num_heads")
            kv_heads = self.num_kv_heads or self.num_heads
            require_divisible(self.num_heads, kv_heads, "num_heads must be divisible by num_kv_heads")
            if (self.hidden_size // self.num_heads) % 2:
                raise ModelConfigError(
                    f"num_heads: head_dim = hidden_size // num_heads = {self.hidden_size // self.num_heads} "
                    "must be even (RoPE rotates pairs of dimensions)"
                )
        else:
            LayerWiseScaling.from_dict(self.layer_wise_scaling)
            for name in ("num_kv_heads", "intermediate_size"):
                if getattr(self, name) is not None:
                    raise ModelConfigError(f"{name}: layer_wise_scaling sets it per layer; remove {name}")
        if (
            isinstance(self.rope_theta, bool)
            or not isinstance(self.rope_theta, (int, float))
            or self.rope_theta <= 0
        ):
            raise ModelConfigError(
                f"rope_theta must be a positive number, got {self.rope_theta!r} (flame's attention always applies "
                "RoPE, as FLA's does)"
            )
        if self.window_size is not None and self.window_size <= 0:
            raise ModelConfigError(f"window_size must be a positive integer or null, got {self.window_size}")
        if self.window_pattern is not None:
            if self.window_size is not None:
                raise ModelConfigError("window_pattern and window_size exclude each other; keep one")
            if not isinstance(self.window_pattern, list) or not self.window_pattern:
                raise ModelConfigError(
                    f"window_pattern must be a non-empty list, got {self.window_pattern!r}"
                )
            for window in self.window_pattern:
                if window is not None and (
                    not isinstance(window, int) or isinstance(window, bool) or window <= 0
                ):
                    raise ModelConfigError(
                        f"window_pattern entries must be positive integers or null, got {window!r}"
                    )

    def layer_window(self, layer_id: int) -> int | None:
        if self.window_pattern is None:
            return self.window_size
        return self.window_pattern[layer_id % len(self.window_pattern)]

    def layer_dims(self, layer_id: int) -> LayerDims:
        if self.layer_wise_scaling is not None:
            lws = LayerWiseScaling.from_dict(self.layer_wise_scaling)
            return lws.layer_dims(layer_id, self.num_hidden_layers, self.hidden_size)
        return LayerDims(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads or self.num_heads,
            head_dim=self.hidden_size // self.num_heads,
            intermediate_size=swiglu_intermediate_size(
                self.hidden_size, self.hidden_ratio, self.intermediate_size
            ),
        )

    def layer_flops_per_token(self, seq_len: int) -> int:
        # Attention scores and weighted sum: 2 matmuls of head_dim x seq_len per head, x3 for forward + backward.
        # Counted over the full (non-causal) square as torchtitan does, so MFU is comparable with its numbers.
        total = 0
        for i in range(self.num_hidden_layers):
            dims, window = self.layer_dims(i), self.layer_window(i)
            context = min(seq_len, window) if window else seq_len
            total += 12 * dims.num_heads * dims.head_dim * context
        return total
