"""The Gated DeltaNet decay gate (Mamba2-style), which FLA 0.6.0 can fuse into its kernel (`use_gate_in_kernel`).

    g = -exp(A_log) * softplus(a + dt_bias)      (log-space decay per token and value head, always <= 0)

with a [..., HV] the raw a_proj output, A_log and dt_bias [HV]. FLA's reference `naive_gdn_gate` and its kernels
compute this in float32 with softplus(x) = x for x > 20, which is `F.softplus`'s default threshold.
"""

import torch
import torch.nn.functional as F

from flame.compat import contiguous_gradient

ContiguousGradient = contiguous_gradient()


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Log-space decay g from the raw gate input a [..., HV]; float32 (float64 for float64 inputs)."""
    compute_dtype = torch.promote_types(a.dtype, torch.float32)
    a = a.to(compute_dtype)
    if dt_bias is not None:
        a = a + dt_bias.to(compute_dtype)
    g = -A_log.to(compute_dtype).exp() * F.softplus(a)
    # Only a traced backward can meet the stride mismatch the shim works around; eager runs skip its autograd node.
    return ContiguousGradient.apply(g) if torch.compiler.is_compiling() else g
