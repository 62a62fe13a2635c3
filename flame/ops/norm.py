"""RMSNorm, gated RMSNorm and the L2 normalisation used inside the delta-rule kernels.

The semantics follow FLA 0.6.0's Triton kernels (`fla.modules.norm`):
- `rms_norm`: y = x * rsqrt(mean(x^2) + eps) * weight, computed in float32 (float64 stays float64), cast back to
  x.dtype. This is what `fla.modules.RMSNorm` (bias=False, no residual) computes.
- `gated_rms_norm`: y = rms_norm(x) * weight * act(gate), again all in float32 with one cast at the end; act is
  silu ('swish' and 'silu' are aliases) or sigmoid. This is `fla.modules.FusedRMSNormGated`: the gate is applied
  AFTER the normalisation and the weight (Mamba2's norm_before_gate=True).
- `l2norm`: x * rsqrt(sum(x^2) + eps) with eps = 1e-6 inside the square root, as FLA's `l2norm_fwd` (used by
  `use_qk_l2norm_in_kernel`); unlike `F.normalize`, which divides by max(||x||, eps).

On CUDA tensors in eager mode `rms_norm` and `gated_rms_norm` call FLA's fused Triton kernels; elsewhere, and under
torch.compile (where inductor fuses the PyTorch code with the residual adds and gates around it, and FLA's kernel
would split the compiled block into several graphs), the PyTorch code here (flame/ops/dispatch.py).
"""

import torch
import torch.nn.functional as F

from flame.models.common.choices import GATE_ACTIVATIONS
from flame.ops import dispatch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision and float32 inputs, float64 for float64 ones."""
    return torch.promote_types(x.dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise the last dimension to unit L2 norm the way FLA's in-kernel l2norm does."""
    x_f = x.to(_compute_dtype(x))
    return (x_f * torch.rsqrt(x_f.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_normalize_in_compute_dtype(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, left in the compute dtype so that a gate can follow before the cast."""
    compute_dtype = _compute_dtype(x)
    x_f = x.to(compute_dtype)
    y = x_f * torch.rsqrt(x_f.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(compute_dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """PyTorch RMSNorm over the last dimension; weight [D] or None (no affine)."""
    return _rms_normalize_in_compute_dtype(x, weight, eps).to(x.dtype)


def gated_rms_norm_torch(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float, activation: str = "swish"
) -> torch.Tensor:
    """PyTorch RMSNorm(x) * weight * act(gate) over the last dimension."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
    y = _rms_normalize_in_compute_dtype(x, weight, eps)
    gate_f = gate.to(y.dtype)
    y = y * (torch.sigmoid(gate_f) if activation == "sigmoid" else F.silu(gate_f))
    return y.to(x.dtype)


def fla_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """FLA 0.6.0's Triton RMSNorm, imported on first use (importing fla pulls in Triton)."""
    from fla.modules.norm.layernorm import rms_norm as fla_op

    return fla_op(x, weight, None, eps=eps)


def fla_gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float, activation: str
) -> torch.Tensor:
    """FLA 0.6.0's fused Triton gated RMSNorm, imported on first use."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated as fla_op

    return fla_op(x, gate, weight, None, activation=activation, eps=eps)


# The backward passes of FLA's norms run from autograd's engine, outside the forward call the table guards.
RMS_NORM = dispatch.register_op(
    "rms_norm",
    rms_norm_torch,
    {"fla": dispatch.Backend(fla_rms_norm, code=("fla.modules.norm.layernorm.",))},
    eager_only=True,
)
GATED_RMS_NORM = dispatch.register_op(
    "gated_rms_norm",
    gated_rms_norm_torch,
    {"fla": dispatch.Backend(fla_gated_rms_norm, code=("fla.modules.norm.fused_norm_gate.",))},
    eager_only=True,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: FLA's kernel on CUDA in eager, `rms_norm_torch` elsewhere and under
    torch.compile."""
    return RMS_NORM(x, weight, eps)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float, activation: str = "swish"
) -> torch.Tensor:
    """RMSNorm(x) * weight * act(gate): FLA's kernel on CUDA in eager, PyTorch elsewhere and under
    torch.compile."""
    return GATED_RMS_NORM(x, gate, weight, eps, activation)


def group_rms_norm_gated_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """PyTorch code of FLA 0.6.0's ``fla.modules.norm.layernorm_gated.rmsnorm_fn`` (the RMSNormGated of its Mamba2
    and Mamba3 layers), its arguments and results: RMSNorm over each group of ``group_size`` channels (all of them
    when None), times weight, plus bias; silu(z) multiplies the result (``norm_before_gate``) or the input; in the
    compute dtype, cast to x's."""
    compute_dtype = _compute_dtype(x)
    h = x.to(compute_dtype)
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.to(compute_dtype))
    groups = torch.unflatten(h, -1, (-1, group_size or h.shape[-1]))
    y = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.to(
        compute_dtype
    )
    if bias is not None:
        y = y + bias.to(compute_dtype)
    if z is not None and norm_before_gate:
        y = y * F.silu(z.to(compute_dtype))
    return y.to(x.dtype)


def residual_rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch code of FLA 0.6.0's ``fla.modules.norm.layernorm.rms_norm``, its arguments and results: h = x +
    residual (when given), summed in the compute dtype; y = h * rsqrt(mean(h^2) + eps) * weight + bias in x's dtype;
    with ``prenorm`` also h, in the residual's dtype (float32 with ``residual_in_fp32`` and no residual, else x's)."""
    compute_dtype = _compute_dtype(x)
    h = x.to(compute_dtype)
    if residual is not None:
        h = h + residual.to(compute_dtype)
    y = _rms_normalize_in_compute_dtype(h, weight, eps)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    y = y.to(x.dtype)
    if not prenorm:
        return y
    residual_dtype = (
        residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    )
    return y, h.to(residual_dtype)
