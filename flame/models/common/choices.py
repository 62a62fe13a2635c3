"""The values flame's model configs choose from, and their checks, without torch: the families' args validate a
config with these alone, so that train.sh's pre-flight checks a config without importing torch or the layers that
use them."""

from flame.errors import ModelConfigError

# attn_impl -> (score normalisation, queries scaled by a learnable per-head factor and log(position + 2))
ATTN_IMPLS: dict[str, tuple[str, bool]] = {
    "parallel_attn": ("softmax", False),
    "parallel_softpick_attn": ("softpick", False),
    "parallel_rectified_attn": ("rectified", False),
    "parallel_scaled_softpick_attn": ("softpick", True),
    "parallel_scaled_attn": ("softmax", True),
}
ATTN_IMPLS.update({name.replace("parallel_", "naive_"): spec for name, spec in list(ATTN_IMPLS.items())})

# What attention's q/k norms normalise: each head's vector, or the whole projection (all heads at once).
QK_NORM_SCOPES = ("head", "full")

# Where a block's two RMSNorms sit on the residual branches: "pre" normalises the branch input (x + f(norm(x)),
# FLA's and Llama's blocks), "post" the branch output (x + norm(f(x)), OLMo 2/3's "reordered norm"; not the original
# Transformer's norm(x + f(x))). Both keep the names attn_norm and mlp_norm (flame.models.common.decoder.Block).
NORM_ORDERS = ("pre", "post")

# Activations of a gated RMSNorm's gate (GatedDeltaNet's output gate; flame.ops.norm).
GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")

# DeltaNet's q/k feature map and norm.
QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
QK_NORMS = ("l2", "sum")


def check_attn_impl(attn_impl: str) -> None:
    if attn_impl not in ATTN_IMPLS:
        raise ModelConfigError(f"attn_impl '{attn_impl}' is unknown; choose one of: {', '.join(ATTN_IMPLS)}")


def check_qk_norm_scope(qk_norm_scope: str) -> None:
    if qk_norm_scope not in QK_NORM_SCOPES:
        raise ModelConfigError(
            f"qk_norm_scope {qk_norm_scope!r} is unknown; choose one of: {', '.join(QK_NORM_SCOPES)}"
        )


def swiglu_intermediate_size(
    hidden_size: int, hidden_ratio: float | None, intermediate_size: int | None
) -> int:
    """FLA's rule: 2/3 * hidden * ratio, rounded up to a multiple of 256, unless given explicitly."""
    if intermediate_size is not None:
        return intermediate_size
    size = int(hidden_size * (hidden_ratio if hidden_ratio is not None else 4) * 2 / 3)
    return 256 * ((size + 255) // 256)
