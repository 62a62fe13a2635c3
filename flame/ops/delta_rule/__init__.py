"""Delta rule (DeltaNet's sequence mixer) with the semantics of FLA 0.6.0's `fla.ops.delta_rule`.

The delta rule is the gated delta rule without decay, so the PyTorch side reuses the gated code with g=None
(`naive_recurrent_gated_delta_rule` is its ground truth, `chunk_gated_delta_rule_torch` its CPU path). Layouts are
FLA's: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; states key-first [N, H, K, V], float32 (float64 for
float64 inputs); o in q's dtype.

FLA's DeltaNet layer calls `fused_recurrent_delta_rule` for sequences of at most 64 tokens (training included) and
`chunk_delta_rule` otherwise; both dispatchers keep FLA's signatures. CUDA tensors go to FLA's Triton ops (the
chunked one through flame's custom ops under torch.compile: flame/ops/fla_library.py), others to the shared PyTorch
code (flame/ops/dispatch.py).
FLA's chunk kernel takes only half-precision inputs: a float32 or float64 chunk call on CUDA runs the PyTorch code
there (one log line). Its fused-recurrent kernel also accepts a per-channel beta [B, T, H, V], which the PyTorch
path rejects (FLA's DeltaNet layer never passes one).
"""

import torch

from flame.ops import dispatch
from flame.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_torch
from flame.ops.norm import l2norm
from flame.ops.varlen import check_packed_batch


def fla_chunk_delta_rule(*args, **kwargs):
    """FLA 0.6.0's chunked Triton op, imported on first use (importing fla.ops pulls in Triton). Under torch.compile,
    and wherever the forward keeps the chunk states for the backward (`fla_library.set_chunk_states`), it runs
    through flame's torch.library custom ops (`flame.ops.fla_library`), so that a DeltaNet block compiles to one
    graph instead of breaking at FLA's ``torch.compiler.disable``."""
    from flame.ops import fla_library

    if torch.compiler.is_compiling() or fla_library.saves_chunk_states():
        return fla_library.chunk_delta_rule(*args, **kwargs)
    from fla.ops.delta_rule import chunk_delta_rule as fla_op

    return fla_op(*args, **kwargs)


def fla_fused_recurrent_delta_rule(*args, **kwargs):
    """FLA 0.6.0's fused recurrent Triton op, imported on first use."""
    from fla.ops.delta_rule import fused_recurrent_delta_rule as fla_op

    return fla_op(*args, **kwargs)


def pytorch_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int = 64,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PyTorch implementation of both ops (``cu_seqlens_cpu`` only saves FLA work)."""
    if beta is None:  # fused_recurrent_delta_rule's beta = 1
        beta = torch.ones_like(q[..., 0])
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError(
            f"q, k and v must have the same number of heads, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}"
        )
    if beta.ndim != 3:
        raise ValueError(f"beta must be [B, T, H] on the PyTorch path, got shape {tuple(beta.shape)}")
    check_packed_batch(q.shape[0], cu_seqlens, initial_state)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return chunk_gated_delta_rule_torch(
        q,
        k,
        v,
        None,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )


def fla_chunk_refuses(q, *args, **kwargs) -> str | None:
    # FLA's ChunkDeltaRuleFunction asserts half-precision inputs (upstream flame issue 30: DeltaNet in float32).
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"takes bfloat16 and float16 inputs, not {str(q.dtype).removeprefix('torch.')}"
    return None


CHUNK_DELTA_RULE = dispatch.register_op(
    "chunk_delta_rule",
    pytorch_delta_rule,
    {
        "fla": dispatch.Backend(
            fla_chunk_delta_rule,
            refuses=fla_chunk_refuses,
            requires=("fla",),
            code=(
                "flame.ops.fla_library.delta_rule_",
                "flame.ops.fla_library._delta_",
                "fla.ops.delta_rule.chunk.",
            ),
        )
    },
)
FUSED_RECURRENT_DELTA_RULE = dispatch.register_op(
    "fused_recurrent_delta_rule",
    pytorch_delta_rule,
    {"fla": dispatch.Backend(fla_fused_recurrent_delta_rule, code=("fla.ops.delta_rule.fused_recurrent.",))},
)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule, FLA's chunked op on CUDA. Returns (o [B, T, H, V], final state [N, H, K, V] or None)."""
    return CHUNK_DELTA_RULE(
        q,
        k,
        v,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_size=chunk_size,
    )


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule, FLA's fused recurrent op on CUDA; beta=None means beta = 1. Same results as `chunk_delta_rule`."""
    return FUSED_RECURRENT_DELTA_RULE(
        q,
        k,
        v,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
    )


__all__ = [
    "chunk_delta_rule",
    "fla_chunk_delta_rule",
    "fla_fused_recurrent_delta_rule",
    "fused_recurrent_delta_rule",
    "pytorch_delta_rule",
]
