"""Attention of the softmax / softpick / rectified family behind one signature.

`attention(q, k, v, *, impl, causal, window_size, cu_seqlens, scale)` dispatches on device and impl:
- CUDA, causal softmax: `cuda_softmax_implementation`: torch SDPA (FlashAttention backend) for plain causal
  batches, FLA's Triton `parallel_attn` (GQA, sliding windows, cu_seqlens) otherwise;
- CUDA, causal softpick / rectified: flame's fused Triton kernel (softpick_triton.py; GQA, sliding windows,
  cu_seqlens, head dims up to 128, memory linear in T);
- everything else (CPU, causal=False): the materialized O(T^2) `reference_attention`.
`set_attention_backend` (train.sh: `--model.attention_backend`) changes the CUDA choice where several kernels
exist: "auto" (the above), "fla" (FLA's `parallel_attn` for every causal softmax call, SDPA never) or
"reference" (the materialized PyTorch attention for every call: the numerics reference, O(T^2) memory).
reference.py defines the semantics every path follows (masking, softpick's eps = SOFTPICK_EPS in the shifted
space, all-zero rows). Importing this package imports neither FLA nor Triton; the CUDA branches do on first use.
"""

import torch
import torch.nn.functional as F

from flame.ops.attention.observe import notify_observers, observe_attention
from flame.ops.attention.reference import (
    IMPLS,
    SOFTPICK_EPS,
    rectified_softmax_weights,
    reference_attention,
    softpick_weights,
    visibility_mask,
)
from flame.ops.attention.scaling import scale_queries_by_position

ATTENTION_BACKENDS = ("auto", "fla", "reference")
_backend = "auto"


def set_attention_backend(name: str) -> None:
    """Which kernels serve CUDA attention from now on (see the module docstring); process-wide."""
    global _backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    _backend = name


def fla_parallel_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int | None,
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """FLA 0.6.0's causal softmax attention kernel, imported on first use (importing fla.ops pulls in Triton)."""
    from fla.ops.attn import parallel_attn

    return parallel_attn(q, k, v, scale=scale, window_size=window_size, cu_seqlens=cu_seqlens)


def cuda_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int | None,
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """SDPA's flash kernel where it applies (the fastest causal softmax on the GPUs here), else FLA's."""
    if window_size is None and cu_seqlens is None and _backend != "fla":
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2)
    return fla_parallel_attn(q, k, v, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale)


# What serves CUDA tensors; assign a function with the same signature to use another kernel.
cuda_softmax_implementation = cuda_softmax_attention


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    impl: str,
    causal: bool = True,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, T, HKV, D] -> [B, T, H, D]; impl is "softmax", "softpick" or "rectified"."""
    notify_observers(
        q, k, impl=impl, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
    )
    if q.is_cuda and impl == "softmax" and causal and _backend != "reference":
        return cuda_softmax_implementation(
            q, k, v, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
        )
    if q.is_cuda and impl in ("softpick", "rectified") and causal and _backend != "reference":
        from flame.ops.attention.softpick_triton import softpick_attention

        return softpick_attention(
            q, k, v, variant=impl, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
        )
    return reference_attention(
        q, k, v, impl=impl, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
    )


__all__ = [
    "ATTENTION_BACKENDS",
    "IMPLS",
    "SOFTPICK_EPS",
    "attention",
    "cuda_softmax_attention",
    "cuda_softmax_implementation",
    "fla_parallel_attn",
    "observe_attention",
    "rectified_softmax_weights",
    "reference_attention",
    "scale_queries_by_position",
    "set_attention_backend",
    "softpick_weights",
    "visibility_mask",
]
