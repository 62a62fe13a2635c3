"""PyTorch code of the FLA 0.6.0 elementwise activations that Mamba's and Samba's blocks call
(``fla.modules.activations``), with their arguments and results: each computes in float32 (float64 stays float64)
and returns its first input's dtype, as FLA's Triton kernels do. Compiled regions run these in place of FLA's
kernels (flame.compat.fla_functions_traced_under_compile), where inductor fuses them with the code around them."""

import torch
import torch.nn.functional as F


def _compute(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def swish(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) (FLA's ``swish``, its ACT2FN 'silu' and 'swish')."""
    return F.silu(_compute(x)).to(x.dtype)


def swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """swish(x) * y."""
    return (F.silu(_compute(x)) * _compute(y)).to(x.dtype)


def swiglu_linear(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """swiglu(x, y) @ weight^T + bias (FLA's SwiGLULinear: under autocast the linear runs in autocast's dtype)."""
    return F.linear(swiglu(x, y), weight, bias)
