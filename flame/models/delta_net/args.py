"""Arguments of the DeltaNet family; fields and defaults follow FLA 0.6.0's DeltaNetConfig."""

import math
from dataclasses import dataclass
from typing import ClassVar

from flame.errors import ModelConfigError
from flame.models.common.args import require_positive_int
from flame.models.common.choices import QK_ACTIVATIONS, QK_NORMS
from flame.models.common.flops import chunked_delta_rule_flops_per_token
from flame.models.common.hybrid import HybridModelArgs


@dataclass
class DeltaNetArgs(HybridModelArgs):
    model_type: ClassVar[str] = "delta_net"

    num_heads: int = 16
    expand_k: float = 1.0
    expand_v: float = 1.0
    use_beta: bool = True
    use_gate: bool = False
    use_short_conv: bool = True
    conv_size: int = 4
    allow_neg_eigval: bool = False
    qk_activation: str = "silu"
    qk_norm: str = "l2"

    def validate(self) -> None:
        super().validate()
        require_positive_int(self, "num_heads")
        for name in ("expand_k", "expand_v"):
            dim = self.hidden_size * getattr(self, name)
            if dim <= 0 or not math.isclose(dim, round(dim)):
                raise ModelConfigError(f"{name}: hidden_size * {name} = {dim} must be a positive integer")
            if round(dim) % self.num_heads:
                raise ModelConfigError(
                    f"num_heads: hidden_size * {name} = {round(dim)} is not divisible by num_heads ({self.num_heads})"
                )
        if self.use_short_conv:
            require_positive_int(self, "conv_size")
        if self.qk_activation not in QK_ACTIVATIONS:
            raise ModelConfigError(
                f"qk_activation must be one of {', '.join(QK_ACTIVATIONS)}, got {self.qk_activation!r}"
            )
        if self.qk_norm not in QK_NORMS:
            raise ModelConfigError(f"qk_norm must be one of {', '.join(QK_NORMS)}, got {self.qk_norm!r}")

    def mixer_flops_per_token(self) -> int:
        head_k_dim = round(self.hidden_size * self.expand_k) // self.num_heads
        head_v_dim = round(self.hidden_size * self.expand_v) // self.num_heads
        return self.num_heads * chunked_delta_rule_flops_per_token(head_k_dim, head_v_dim)
