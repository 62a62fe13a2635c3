"""Arguments of the transformer family; fields and defaults follow FLA 0.6.0's TransformerConfig."""

from dataclasses import dataclass
from typing import ClassVar

from flame.errors import ModelConfigError
from flame.models.common.args import ModelArgs, require_divisible
from flame.models.layers.attention import check_attn_impl


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

    def validate(self) -> None:
        super().validate()
        check_attn_impl(self.attn_impl)
        require_divisible(self.hidden_size, self.num_heads, "hidden_size must be divisible by num_heads")
        kv_heads = self.num_kv_heads or self.num_heads
        require_divisible(self.num_heads, kv_heads, "num_heads must be divisible by num_kv_heads")
        if self.window_size is not None and self.window_size <= 0:
            raise ModelConfigError(f"window_size must be a positive integer or null, got {self.window_size}")

    def layer_flops_per_token(self, seq_len: int) -> int:
        # Attention scores and weighted sum: 2 matmuls of head_dim x seq_len per head, x3 for forward + backward.
        # Counted over the full (non-causal) square as torchtitan does, so MFU is comparable with its numbers.
        context = min(seq_len, self.window_size) if self.window_size else seq_len
        return 12 * self.num_hidden_layers * self.hidden_size * context
