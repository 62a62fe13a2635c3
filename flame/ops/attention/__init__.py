"""Attention of the softmax / softpick / rectified family behind one signature.

`attention(q, k, v, *, impl, causal, window_size, cu_seqlens, scale)` sends causal calls on CUDA tensors to the
backend pinned in the dispatch table (flame/ops/dispatch.py; train.sh: `--model.attention_backend`), everything
else (CPU, causal=False) to the materialized O(T^2) `reference_attention`. Backends (`BACKENDS`):
- "auto" (default): softmax through torch SDPA (its own kernel choice: cuDNN on H100/H200 with torch 2.11, else
  FlashAttention) for plain causal batches and FLA's Triton
  `parallel_attn` (GQA, sliding windows, cu_seqlens) otherwise; softpick / rectified through flame's fused Triton
  kernel (softpick_triton.py; GQA, sliding windows, cu_seqlens, head dims up to 128, memory linear in T);
- "fla": as auto, but FLA's `parallel_attn` for every softmax call with as many queries as keys (SDPA never there);
- "flash" / "cudnn": as auto, but plain causal softmax with as many queries as keys pinned to SDPA's FlashAttention
  / cuDNN kernel (a run that must not change kernels with the torch version, or a kernel that is faster there);
- "reference": the materialized PyTorch attention for every call (the numerics reference, O(T^2) memory).

Fewer queries than keys (Tq < Tk, context parallelism: a rank's queries against the keys up to its slice's end)
aligns the queries to the end of the keys (reference.py). On CUDA, in the "auto" and "fla" backends, softpick /
rectified run the fused kernel (also with a window); softmax runs SDPA with `causal_lower_right(Tq, Tk)` as its
mask, or with a window the materialized `reference_attention` (O(Tq Tk) memory: neither SDPA's causal bias nor
FLA's `parallel_attn`, which assumes Tq == Tk, has a bottom-right window). cu_seqlens with Tq != Tk is refused.

reference.py defines the semantics every path follows (masking, softpick's eps = SOFTPICK_EPS in the shifted
space, all-zero rows). Importing this package imports neither FLA nor Triton; the CUDA branches do on first use.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flame.ops import dispatch
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


def fla_parallel_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int | None,
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """FLA 0.6.0's causal softmax attention kernel (as many queries as keys only), imported on first use
    (importing fla.ops pulls in Triton)."""
    from fla.ops.attn import parallel_attn

    return parallel_attn(q, k, v, scale=scale, window_size=window_size, cu_seqlens=cu_seqlens)


def causal_lower_right_bias(q_len: int, k_len: int):
    """SDPA's lower-right causal bias; its module imports torch._dynamo (~1.7 s), so it loads at the first call
    rather than with flame (train.sh's pre-flight never needs it)."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(q_len, k_len)


def sdpa_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Causal softmax through torch SDPA (the kernel SDPA picks, or the one an sdpa_kernel context pins), Tq <= Tk
    with the queries aligned to the end of the keys: is_causal is top-left aligned, so fewer queries take a
    lower-right causal bias."""
    causal = (
        {"is_causal": True}
        if q.shape[1] == k.shape[1]
        else {"attn_mask": causal_lower_right_bias(q.shape[1], k.shape[1])}
    )
    # enable_gqa only where the head counts differ, so multi-head calls take SDPA's plain path.
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
        **causal,
    )
    return out.transpose(1, 2)


def cuda_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int | None,
    cu_seqlens: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """SDPA where it applies (the fastest causal softmax on the GPUs here), else FLA's kernel; a window with fewer
    queries than keys has neither, and takes the materialized reference (which refuses cu_seqlens there)."""
    if window_size is None and cu_seqlens is None and q.shape[1] <= k.shape[1]:
        return sdpa_causal_attention(q, k, v, scale)
    if q.shape[1] != k.shape[1]:
        return reference_attention(
            q, k, v, impl="softmax", window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
        )
    return fla_parallel_attn(q, k, v, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale)


def auto_cuda_attention(q, k, v, *, impl, window_size, cu_seqlens, scale) -> torch.Tensor:
    """The "auto" backend: the fastest kernel of each impl."""
    if impl == "softmax":
        return cuda_softmax_attention(q, k, v, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale)
    from flame.ops.attention.softpick_triton import softpick_attention

    return softpick_attention(
        q, k, v, variant=impl, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
    )


def fla_cuda_attention(q, k, v, *, impl, window_size, cu_seqlens, scale) -> torch.Tensor:
    """The "fla" backend: FLA's kernel for softmax with Tq == Tk, the auto backend's for the rest."""
    if impl == "softmax" and q.shape[1] == k.shape[1]:
        return fla_parallel_attn(q, k, v, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale)
    return auto_cuda_attention(
        q, k, v, impl=impl, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
    )


def pinned_sdpa_backend(kernel: SDPBackend):
    """A backend like auto whose plain causal softmax with Tq == Tk runs SDPA's ``kernel`` (or raises if that kernel
    cannot take the inputs: a pin never falls back silently)."""

    def pinned(q, k, v, *, impl, window_size, cu_seqlens, scale) -> torch.Tensor:
        if impl == "softmax" and window_size is None and cu_seqlens is None and q.shape[1] == k.shape[1]:
            with sdpa_kernel(kernel):
                return sdpa_causal_attention(q, k, v, scale)
        return auto_cuda_attention(
            q, k, v, impl=impl, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
        )

    return pinned


def reference_causal_attention(q, k, v, *, impl, window_size, cu_seqlens, scale) -> torch.Tensor:
    """The "reference" backend, and what serves causal calls off CUDA."""
    return reference_attention(
        q, k, v, impl=impl, causal=True, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
    )


# Every backend but the reference runs the softpick family on flame's kernel, whose custom ops a compiled graph
# calls directly.
SOFTPICK_KERNEL = ("flame.ops.attention.softpick_triton.",)
BACKENDS = {
    "auto": dispatch.Backend(auto_cuda_attention, code=SOFTPICK_KERNEL),
    "fla": dispatch.Backend(fla_cuda_attention, code=(*SOFTPICK_KERNEL, "fla.ops.attn.")),
    "flash": dispatch.Backend(pinned_sdpa_backend(SDPBackend.FLASH_ATTENTION), code=SOFTPICK_KERNEL),
    "cudnn": dispatch.Backend(pinned_sdpa_backend(SDPBackend.CUDNN_ATTENTION), code=SOFTPICK_KERNEL),
    "reference": reference_causal_attention,
}
ATTENTION_BACKENDS = tuple(BACKENDS)
# Causal calls; non-causal ones take the reference on every device (attention() below).
ATTENTION = dispatch.register_op("attention", reference_causal_attention, BACKENDS)


def set_attention_backend(name: str) -> None:
    """Which kernels serve CUDA attention from now on (see the module docstring); process-wide."""
    dispatch.pin("attention", name)


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
    """q [B, Tq, H, D], k/v [B, Tk, HKV, D] with Tk >= Tq -> [B, Tq, H, D]; impl is "softmax", "softpick" or
    "rectified". Query i sits at position i + Tk - Tq (the queries are the last Tq positions of the keys)."""
    notify_observers(
        q, k, impl=impl, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
    )
    if causal:
        if window_size is not None and window_size >= k.shape[1]:
            window_size = None  # it hides no key: the plain causal kernels (SDPA's) serve the call
        return ATTENTION(q, k, v, impl=impl, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale)
    return reference_attention(
        q, k, v, impl=impl, causal=False, window_size=window_size, cu_seqlens=cu_seqlens, scale=scale
    )


__all__ = [
    "ATTENTION_BACKENDS",
    "BACKENDS",
    "IMPLS",
    "SOFTPICK_EPS",
    "attention",
    "cuda_softmax_attention",
    "fla_parallel_attn",
    "observe_attention",
    "rectified_softmax_weights",
    "reference_attention",
    "scale_queries_by_position",
    "set_attention_backend",
    "softpick_weights",
    "visibility_mask",
]
