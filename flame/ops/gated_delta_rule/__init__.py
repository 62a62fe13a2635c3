"""Gated delta rule (Gated DeltaNet's sequence mixer) with the semantics of FLA 0.6.0's `chunk_gated_delta_rule`.

`chunk_gated_delta_rule` takes FLA's arguments in FLA's order and dispatches on the device of q (flame/ops/dispatch.py):
CUDA tensors go to FlashQLA where it is installed and takes the call (flash_qla.py: K = V = 128 on Hopper and
datacenter Blackwell), else to FLA's Triton kernel; anything else goes to `pytorch_chunk_gated_delta_rule`, which
applies in PyTorch what FLA fuses into its kernel and runs the chunked code in `chunk.py`:

- use_qk_l2norm_in_kernel: q, k <- x * rsqrt(sum(x^2) + 1e-6) (flame.ops.norm.l2norm);
- use_beta_sigmoid_in_kernel: beta <- sigmoid(beta), times 2 if allow_neg_eigval (which requires the former);
- use_gate_in_kernel: g <- -exp(A_log) * softplus(g + dt_bias) (gate.py); otherwise g is already the log decay;
- state_v_first: initial and final states are [N, HV, V, K] instead of FLA's default key-first [N, HV, K, V].
  FLA's GatedDeltaNet layer passes state_v_first=True, so its cached states are value-first.

Final states are float32 (float64 for float64 inputs) and o has q's dtype, as in FLA. Context parallelism
(`cp_context`) exists only in FLA's kernels; `cu_seqlens_cpu` and `chunk_indices` only save FLA work and are
ignored on CPU. FLA's deprecated `transpose_state_layout` / `head_first` keywords are not accepted.

Another kernel for CUDA tensors is one more entry in `GATED_DELTA_RULE`'s backends.
"""

import torch

from flame.ops import dispatch
from flame.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_torch
from flame.ops.gated_delta_rule.flash_qla import flash_qla_chunk_gated_delta_rule, flash_qla_refuses
from flame.ops.gated_delta_rule.gate import gdn_gate
from flame.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from flame.ops.norm import l2norm
from flame.ops.varlen import check_packed_batch

# FLA's kernels take these chunk sizes; the CPU path accepts the same so that a setting valid here is valid on GPU.
CHUNK_SIZES = (16, 32, 64)


def fla_chunk_gated_delta_rule(*args, **kwargs):
    """FLA 0.6.0's Triton op, imported on first use (importing fla.ops pulls in Triton). Under torch.compile, and
    wherever the forward keeps the chunk states for the backward (`fla_library.set_chunk_states`), it runs through
    flame's torch.library custom ops (`flame.ops.fla_library`), so that a block compiles to one graph instead of
    breaking at FLA's ``torch.compiler.disable``, and which run flame's state recurrence and dh recurrence
    (fwd_h_triton.py, dhu_triton.py) for bf16 inputs with value-first states (the layer's); FLA's context
    parallelism (``cp_context``) stays on FLA's op.
    On Hopper GPUs with Triton 3.4-3.7.0, where FLA refuses its own gated dq/dk/dw/dg, FLA's TileLang kernel or
    flame's Triton one (dqkwg_triton.py) serves it, ranked per call (flame.compat.serve_gated_dqkwg_on_hopper)."""
    from flame.ops import fla_library

    custom_ops = torch.compiler.is_compiling() or fla_library.saves_chunk_states()
    if custom_ops and kwargs.get("cp_context") is None:
        return fla_library.chunk_gated_delta_rule(*args, **kwargs)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op

    from flame.ops.gated_delta_rule.dqkwg_triton import serve_where_fla_refuses  # imports Triton

    serve_where_fla_refuses()
    return fla_op(*args, **kwargs)


def pytorch_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context=None,
    *,
    chunk_size: int = 64,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PyTorch implementation behind FLA's signature (CPU tensors; the reference of the kernels)."""
    if cp_context is not None:
        raise NotImplementedError("context parallelism (cp_context) needs FLA's CUDA kernels")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same number of heads, got {q.shape[2]} and {k.shape[2]}")
    if v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"value heads ({v.shape[2]}) must be a multiple of query/key heads ({q.shape[2]})")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True requires A_log")
    check_packed_batch(q.shape[0], cu_seqlens, initial_state)

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32)))
        if allow_neg_eigval:
            beta = beta * 2
    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    o, final_state = chunk_gated_delta_rule_torch(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
    if state_v_first and final_state is not None:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state


GATED_DELTA_RULE = dispatch.register_op(
    "chunk_gated_delta_rule",
    pytorch_chunk_gated_delta_rule,
    {
        "flash_qla": dispatch.Backend(
            flash_qla_chunk_gated_delta_rule,
            refuses=flash_qla_refuses,
            requires=("flash_qla", "tilelang"),
            code=("flame.ops.gated_delta_rule.flash_qla.", "flash_qla."),
        ),
        "fla": dispatch.Backend(
            fla_chunk_gated_delta_rule,
            code=(
                "flame.ops.fla_library.gated_delta_rule_",
                "flame.ops.fla_library._gdn_",
                "fla.ops.gated_delta_rule.",
            ),
        ),
    },
)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context=None,
    *,
    chunk_size: int = 64,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over q, k [B, T, H, K], v [B, T, HV, V], g and beta [B, T, HV].

    Returns (o [B, T, HV, V], final state [N, HV, K, V] (or [N, HV, V, K] with state_v_first) or None).
    """
    return GATED_DELTA_RULE(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
        cp_context=cp_context,
        chunk_size=chunk_size,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
    )


__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_torch",
    "pytorch_chunk_gated_delta_rule",
    "fla_chunk_gated_delta_rule",
    "gdn_gate",
    "naive_recurrent_gated_delta_rule",
]
