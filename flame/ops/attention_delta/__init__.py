"""The row-wise dot product of an attention output and its gradient, delta[i] = sum_v o[i, v] do[i, v]: the first
step of a softmax attention's backward (FlashAttention-2's D), which every FLA parallel attention backward computes.

`attention_delta` runs flame's Triton kernel (triton_kernel.py) on CUDA tensors and the PyTorch code (reference.py,
which defines it) elsewhere (flame/ops/dispatch.py). FLA 0.6.0's `parallel_attn_bwd_preprocess` runs one program
per row, which at NSA's head count keeps the GPU launching programs for ~0.63 ms a call where reading the two tensors
takes a tenth of that (docs/performance.md, "Attention backward's delta"); flame.compat.fla_attention_delta_on_flame
puts this op in its place.
"""

import torch

from flame.ops import dispatch
from flame.ops.attention_delta.reference import attention_delta_torch


def triton_attention_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """flame's Triton kernel, imported on first use: importing it pulls in Triton."""
    from flame.ops.attention_delta.triton_kernel import attention_delta_triton

    return attention_delta_triton(o, do)


ATTENTION_DELTA = dispatch.register_op(
    "attention_delta",
    attention_delta_torch,
    {"triton": dispatch.Backend(triton_attention_delta, requires=("triton",))},
)


def attention_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """o, do [..., V] -> delta [...]: float32 (float64 for float64 inputs), summed in that precision."""
    return ATTENTION_DELTA(o, do)


__all__ = ["attention_delta", "attention_delta_torch", "triton_attention_delta"]
