"""FlashQLA (`flash-qla`, the Qwen team's fused TileLang forward and backward of the gated delta rule) as a CUDA
backend of `chunk_gated_delta_rule`, for the calls it takes.

On one H100 it ran a Gated DeltaNet op with 16 heads of K = V = 128 in 1.61 ms against 2.85 ms for FLA's Triton
path (forward + backward, bf16, 8 x 2048 tokens, through FLA 0.6.0's own FlashQLA dispatch, 2026-11-24). Its
limits, which `refuses` states per call (FLA 0.6.0's own FlashQLA backend checks the same): Hopper or datacenter
Blackwell (SM90, SM100, SM103; SM120 has a forward only), bfloat16 or float16 q/k/v of one dtype, K = V = 128, no
negative eigenvalues, no context parallelism across GPUs, and nvcc for TileLang to compile with. The decay gate
and the sigmoid of beta, which FLA's Triton kernel can fuse (`use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`),
are computed here before the call, as FLA's layers did before 0.6.0. Under torch.compile FlashQLA's forward and
backward run as torch.library custom ops (as FLA's do, flame.ops.fla_library), so a compiled block is one graph;
eager calls keep FlashQLA's own autograd Function, which also keeps its forward's context-parallel partitioning
for the backward (the custom ops recompute it there).
"""

import functools
import os
import shutil

import torch
from torch import Tensor

from flame.ops.dispatch import constant_to_compiler

# Contiguous inputs (FLA's input_guard), empty outputs, the fake forward outputs the delta rules' ops share.
from flame.ops.fla_library import _contiguous, _empty, _forward_outputs_like
from flame.ops.gated_delta_rule.gate import gdn_gate

# Compute capabilities whose FlashQLA kernels run forward and backward, and its chunk length on them.
CAPABILITIES = ((9, 0), (10, 0), (10, 3))
CHUNK_SIZE = 64


# The device and nvcc facts are constants to torch.compile (dynamo calls them while it traces a compiled block and
# keeps their results), so that the refusal traces whole where FlashQLA takes the call.
@constant_to_compiler
def device_capability(device: torch.device) -> tuple[int, int]:
    properties = torch.cuda.get_device_properties(device)
    return properties.major, properties.minor


@constant_to_compiler
def nvcc_found() -> bool:
    """TileLang compiles FlashQLA's kernels with nvcc at their first call: on PATH, or under CUDA_HOME (default
    /usr/local/cuda, where the GPU machines keep it)."""
    return _nvcc_on_this_machine()


@functools.cache  # looked up once: the refusal runs on every call (dynamo would trace through the cache wrapper)
def _nvcc_on_this_machine() -> bool:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.access(os.path.join(cuda_home, "bin", "nvcc"), os.X_OK)


def flash_qla_refuses(q, k, v, g, beta, *, allow_neg_eigval=False, cp_context=None, **kwargs) -> str | None:
    """Why FlashQLA cannot serve this call of `chunk_gated_delta_rule` (whose dispatcher passes everything after
    beta by keyword), or None. The checks of the call's own arguments come first: a compiled block traces this
    function, and they decide the calls FlashQLA cannot take without asking the device."""
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return "takes bfloat16 or float16 q, k and v of one dtype"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return f"takes K = V = 128 only, not K = {q.shape[-1]}, V = {v.shape[-1]}"
    if allow_neg_eigval:
        return "has no negative eigenvalues (allow_neg_eigval)"
    if cp_context is not None:
        return "has no context parallelism across GPUs"
    if device_capability(q.device) not in CAPABILITIES:
        return "runs on SM90, SM100 and SM103 GPUs only"
    if not nvcc_found():
        return "needs nvcc (on PATH or under CUDA_HOME) to compile its TileLang kernels"
    return None


def flash_qla_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    **fla_only,
) -> tuple[Tensor, Tensor | None]:
    """FlashQLA's op on the calls `flash_qla_refuses` lets through. Of FLA's other arguments (``fla_only``),
    allow_neg_eigval and cp_context are refused, FlashQLA keeps its own chunk size, and cu_seqlens_cpu and
    chunk_indices only save FLA work."""
    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid().to(beta.dtype)
    if torch.compiler.is_compiling():
        o, final_state, *_ = gated_delta_rule_fwd(
            q, k, v, g, beta, initial_state, cu_seqlens, float(q.shape[-1] ** -0.5 if scale is None else scale),
            output_final_state, use_qk_l2norm_in_kernel, state_v_first,
        )  # fmt: skip
        return o, final_state if output_final_state else None
    import flash_qla

    return flash_qla.chunk_gated_delta_rule(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        auto_cp=True,
    )


@torch.library.custom_op("flame::flash_qla_gated_delta_rule_fwd", mutates_args=(), device_types="cuda")
def gated_delta_rule_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    state_v_first: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, final state, q_normed, q_rstd, k_normed, k_rstd, g cumsum, A), empty where absent: what FlashQLA 0.1.3's
    ``ChunkGatedDeltaRuleFunction.forward`` computes and saves, g the log decay and beta its sigmoid. Its forward
    context-parallel cache is not kept (a custom op returns tensors): both passes decide the intra-GPU partitioning
    as a training step (``is_train``), and the backward recomputes what the cache would hold."""
    from flash_qla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    from flash_qla.utils import l2norm_fwd

    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    q_normed, q_rstd, k_normed, k_rstd = q, _empty(q), k, _empty(k)
    if use_qk_l2norm_in_kernel:
        q_normed, q_rstd = l2norm_fwd(q)
        k_normed, k_rstd = l2norm_fwd(k)
    g_cumsum, A, o, _, final_state, _ = chunk_gated_delta_rule_fwd(
        q=q_normed,
        k=k_normed,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        output_final_state=output_final_state,
        output_h=False,
        auto_cp=True,
        state_v_first=state_v_first,
        enable_fwd_cp_cache=False,
        is_train=True,
    )
    return (
        o.to(q.dtype),
        final_state if output_final_state else _empty(q),
        q_normed if use_qk_l2norm_in_kernel else _empty(q),
        q_rstd,
        k_normed if use_qk_l2norm_in_kernel else _empty(k),
        k_rstd,
        g_cumsum,
        A,
    )


@gated_delta_rule_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel,
      state_v_first):  # fmt: skip
    batch, seq_len, num_v_heads = g.shape[:3]
    return (
        *_forward_outputs_like(
            q, k, v, cu_seqlens, output_final_state, use_qk_l2norm_in_kernel, state_v_first
        ),
        torch.empty_like(g, memory_format=torch.contiguous_format),
        k.new_empty(batch, seq_len, num_v_heads, CHUNK_SIZE),
    )


@torch.library.custom_op("flame::flash_qla_gated_delta_rule_bwd", mutates_args=(), device_types="cuda")
def gated_delta_rule_bwd(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    q_rstd: Tensor | None,
    k: Tensor,
    k_rstd: Tensor | None,
    v: Tensor,
    g_cumsum: Tensor,
    beta: Tensor,
    A: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    state_v_first: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta, dh0) in the dtypes of the forward's inputs, dh0 empty without an initial state; q, k
    the l2-normalised ones when that is on (q_rstd, k_rstd given). As FlashQLA 0.1.3's backward."""
    from flash_qla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd
    from flash_qla.utils import l2norm_bwd

    do, dht, q, q_rstd, k, k_rstd, v, g_cumsum, beta, A, initial_state = _contiguous(
        do, dht, q, q_rstd, k, k_rstd, v, g_cumsum, beta, A, initial_state
    )
    dq, dk, dv, dbeta, dg, dh0 = chunk_gated_delta_rule_bwd(
        q=q,
        k=k,
        v=v,
        g=g_cumsum,
        beta=beta,
        A=A,
        do=do,
        dht=dht,
        scale=scale,
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        state_v_first=state_v_first,
        auto_cp=True,
    )
    if q_rstd is not None:
        dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        dg.to(g_cumsum.dtype),
        dbeta.to(beta.dtype),
        _empty(do) if dh0 is None else dh0.to(initial_state.dtype),
    )


@gated_delta_rule_bwd.register_fake
def _(do, dht, q, q_rstd, k, k_rstd, v, g_cumsum, beta, A, initial_state, cu_seqlens, scale, state_v_first):
    def like(x: Tensor) -> Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    return (
        like(q),
        like(k),
        like(v),
        like(g_cumsum),
        like(beta),
        _empty(do) if initial_state is None else like(initial_state),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, l2norm, state_v_first = inputs
    _, final_state, q_normed, q_rstd, k_normed, k_rstd, g_cumsum, A = output
    ctx.save_for_backward(
        q_normed if l2norm else q,
        q_rstd if l2norm else None,
        k_normed if l2norm else k,
        k_rstd if l2norm else None,
        v,
        g_cumsum,
        beta,
        A,
        initial_state,
        cu_seqlens,
    )
    ctx.scale, ctx.state_v_first, ctx.output_final_state = scale, state_v_first, output_final_state
    ctx.has_initial_state = initial_state is not None
    ctx.mark_non_differentiable(q_normed, q_rstd, k_normed, k_rstd, g_cumsum, A)
    if not output_final_state:
        ctx.mark_non_differentiable(final_state)


def _backward(ctx, do, dht, *_unused_grads):
    dq, dk, dv, dg, dbeta, dh0 = gated_delta_rule_bwd(
        do, dht if ctx.output_final_state else None, *ctx.saved_tensors, ctx.scale, ctx.state_v_first
    )
    return dq, dk, dv, dg, dbeta, dh0 if ctx.has_initial_state else None, None, None, None, None, None


gated_delta_rule_fwd.register_autograd(_backward, setup_context=_setup_context)
