"""Arguments of the Gated DeltaNet family; fields and defaults follow FLA 0.6.0's GatedDeltaNetConfig."""

import math
from dataclasses import dataclass
from typing import ClassVar

from flame.errors import ModelConfigError
from flame.models.common.args import require_positive_int
from flame.models.common.choices import GATE_ACTIVATIONS
from flame.models.common.flops import chunked_delta_rule_flops_per_token
from flame.models.common.hybrid import HybridModelArgs


@dataclass
class GatedDeltaNetArgs(HybridModelArgs):
    model_type: ClassVar[str] = "gated_deltanet"

    num_hidden_layers: int = 21
    head_dim: int = 256
    num_heads: int = 6
    num_v_heads: int | None = None
    expand_v: float = 2.0
    use_gate: bool = True
    output_gate_activation: str = "swish"
    use_short_conv: bool = True
    conv_size: int = 4
    allow_neg_eigval: bool = False
    # flame's: eps of the Gated DeltaNet layers' output norm; None (FLA's behaviour): norm_eps. OLMo-core leaves
    # it at the layer default 1e-5 whatever its block norms use (transformers' olmo_hybrid hard-codes 1e-5).
    output_norm_eps: float | None = None

    def validate(self) -> None:
        super().validate()
        require_positive_int(self, "num_heads", "head_dim")
        if self.num_v_heads is not None:
            require_positive_int(self, "num_v_heads")
            # FLA only checks this when num_v_heads > num_heads; fewer value heads would break its kernels.
            if self.num_v_heads % self.num_heads:
                raise ModelConfigError(
                    f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads ({self.num_heads})"
                )
        head_v_dim = self.head_dim * self.expand_v
        if self.expand_v <= 0 or not math.isclose(head_v_dim, round(head_v_dim)):
            raise ModelConfigError(
                f"expand_v: head_dim * expand_v = {self.head_dim} * {self.expand_v} must be a positive integer"
            )
        if self.output_norm_eps is not None and (
            isinstance(self.output_norm_eps, bool)
            or not isinstance(self.output_norm_eps, (int, float))
            or not 0 < self.output_norm_eps < 1
        ):
            raise ModelConfigError(
                f"output_norm_eps must be null or a number in (0, 1), got {self.output_norm_eps!r}"
            )
        if self.use_short_conv:
            require_positive_int(self, "conv_size")
        if self.output_gate_activation not in GATE_ACTIVATIONS:
            raise ModelConfigError(
                f"output_gate_activation must be one of {', '.join(GATE_ACTIVATIONS)}, "
                f"got {self.output_gate_activation!r}"
            )

    def output_norm_eps_or_default(self) -> float:
        """The eps of the Gated DeltaNet layers' output norm."""
        return self.norm_eps if self.output_norm_eps is None else self.output_norm_eps

    def mixer_flops_per_token(self) -> int:
        # The op runs per value head, with q and k shared by the value heads of a group.
        num_v_heads = self.num_v_heads or self.num_heads
        head_v_dim = round(self.head_dim * self.expand_v)
        return num_v_heads * chunked_delta_rule_flops_per_token(self.head_dim, head_v_dim)
