"""FLA 0.6.0's chunk gated delta rule, chunk delta rule and chunk simple GLA registered as torch.library custom ops.

FLA wraps its public ops in ``torch.compiler.disable`` (and its autograd Functions hold Python state that dynamo does
not trace), so a compiled Gated DeltaNet or DeltaNet block broke into a graph per FLA call: every break costs a return to
Python, guard checks and a separate compiled region in forward and backward. Registered as custom ops with fake
(shape-only) implementations, the forward and backward of each op are single opaque nodes, and a block compiles to
one graph. The Triton work inside is FLA's kernels of both rules, called one by one in the order and with the
arguments of FLA's `chunk_gated_delta_rule_fwd` / `_bwd` and `chunk_delta_rule_fwd` / `_bwd`
(tests/ops/test_fla_library.py compares them call by call), except the sequential recurrences where flame's
kernels take the call (bf16, value-first states): the state recurrence (gated_delta_rule/fwd_h_triton.py), in a
forward that keeps no chunk states the state recurrence and the output in one pass (fwd_o_triton.py), and the dh
recurrence (dhu_triton.py; for small heads with the intra-chunk part of dv, in place of chunk_bwd_dv_local
too). (The short convolution is flame's own custom op: short_conv/triton_kernel.py.)

Composing the kernels gives one choice FLA does not offer (`set_chunk_states`): the forward can keep what its state
recurrence made, the chunk states h (one [K, V] state per 64 tokens and value head), the WY keys w and the new
values v_new, for the backward, where FLA's backward of either rule runs `recompute_w_u_fwd` and
`chunk_gated_delta_rule_fwd_h` again to get them (0.38 ms of the gated op's 2.97 ms of kernels at 8 x 2048 tokens
and 6 heads of K = 256, V = 512 on an H200). Keeping them costs their memory instead.

Custom ops may not return their inputs, so intermediates that FLA saves only sometimes (the l2-normalised q/k, the
sigmoid of beta) come back as empty tensors when they are the input itself, and absent gradients as empty tensors
that the autograd wrapper turns into None; outputs that get no gradient get none (no zero-filled tensors the size
of h). Context parallelism (a Python context object) stays on FLA's own path.
"""

from typing import Literal

import torch
from torch import Tensor

CHUNK_STATES = ("recompute", "save")
_chunk_states: Literal["recompute", "save"] = "recompute"


def set_chunk_states(policy: Literal["recompute", "save"]) -> None:
    """Whether the forward of either delta rule keeps what its backward needs of the state recurrence (``save``:
    h, w and v_new, which cost B x T/64 x HV x K x V plus B x T x HV x (K + V) values in the inputs' dtype per call)
    or the backward recomputes them (``recompute``, FLA's way); process-wide. Packed documents (cu_seqlens), whose
    number of chunks depends on their lengths, always recompute."""
    global _chunk_states
    if policy not in CHUNK_STATES:
        raise ValueError(f"chunk states must be one of {CHUNK_STATES}, got {policy!r}")
    _chunk_states = policy


def saves_chunk_states() -> bool:
    return _chunk_states == "save"


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _gradient_like(x: Tensor | None, do: Tensor) -> Tensor:
    """A backward op's fake gradient for input ``x``: contiguous like it, or empty where the input is absent."""
    return _empty(do) if x is None else torch.empty_like(x, memory_format=torch.contiguous_format)


def _contiguous(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """What FLA's ``input_guard`` does for its Functions: the Triton kernels index every tensor as contiguous. A
    gradient can arrive expanded (the gradient of a sum is one value with stride 0), and read as contiguous it runs
    past its storage into whatever memory follows."""
    return tuple(None if x is None else x.contiguous() for x in tensors)


def _forward_outputs_like(
    q, k, v, cu_seqlens, output_final_state, l2norm, state_v_first
) -> tuple[Tensor, ...]:
    """The fake (shape-only) o, final state, q_normed, q_rstd, k_normed and k_rstd of a delta rule's forward op,
    empty where absent: the final state in float32, one per sequence; the l2 norm's results where it is on."""
    batch, seq_len, num_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[2], v.shape[3]
    num_sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)

    def normed(x: Tensor) -> tuple[Tensor, Tensor]:
        if not l2norm:
            return _empty(x), _empty(x)
        return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
            batch, seq_len, num_heads, dtype=torch.float32
        )

    final_state = q.new_empty(num_sequences, num_v_heads, *state_shape, dtype=torch.float32)
    return (
        q.new_empty(batch, seq_len, num_v_heads, value_dim),
        final_state if output_final_state else _empty(q),
        *normed(q),
        *normed(k),
    )


def _chunk_states_like(k, v, chunk_size, state_v_first, keep) -> tuple[Tensor, Tensor, Tensor]:
    """The fake w, h and v_new a forward op keeps for the backward (empty where it does not keep them)."""
    if not keep:
        return _empty(k), _empty(k), _empty(v)
    batch, seq_len, _, key_dim = k.shape
    num_v_heads, value_dim = v.shape[2], v.shape[3]
    num_chunks = (seq_len + chunk_size - 1) // chunk_size
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    return (
        k.new_empty(batch, seq_len, num_v_heads, key_dim),
        k.new_empty(batch, num_chunks, num_v_heads, *state_shape),
        v.new_empty(batch, seq_len, num_v_heads, value_dim),
    )


def _chunk_indices(
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_size: int
) -> Tensor | None:
    if cu_seqlens is None:
        return None
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


def _state_recurrence(fla, k, state_v_first, chunk_size):
    """The state recurrence's kernel for this call: flame's (fwd_h_triton.py) where it serves the call, else that of
    FLA's namespace ``fla``."""
    from flame.ops.gated_delta_rule import fwd_h_triton

    if fwd_h_triton.serves(k, chunk_size, state_v_first):
        return fwd_h_triton.chunk_fwd_h_triton
    return fla.chunk_gated_delta_rule_fwd_h


def _recurrence_forward(fla, q, k, w, u, g, scale, initial_state, output_final_state, state_v_first, chunk_size,
                        indices, keep):  # fmt: skip
    """What both rules' forwards run after their WY representation, with the kernels of FLA's namespace ``fla`` (the
    rule's chunk module; g None for the plain rule): the state recurrence (flame's kernel where it serves the call),
    then the output; or, where the backward will recompute the states (not ``keep``) and flame's kernel of both in
    one pass serves the call (fwd_o_triton.py), that kernel, which stores neither h nor v_new. (o, final state, h,
    v_new), h and v_new None where not stored."""
    from flame.ops.gated_delta_rule import fwd_o_triton

    recurrence = dict(k=k, w=w, u=u, g=g, initial_state=initial_state, output_final_state=output_final_state,
                      state_v_first=state_v_first, chunk_size=chunk_size, **indices)  # fmt: skip
    if not keep and fwd_o_triton.serves(k, chunk_size, state_v_first):
        o, final_state = fwd_o_triton.chunk_fwd_o_triton(q=q, scale=scale, **recurrence)
        return o, final_state, None, None
    h, v_new, final_state = _state_recurrence(fla, k, state_v_first, chunk_size)(**recurrence)
    o = fla.chunk_fwd_o(
        q=q,
        k=k,
        v=v_new,
        h=h,
        g=g,
        scale=scale,
        state_v_first=state_v_first,
        chunk_size=chunk_size,
        **indices,
    )
    return o, final_state, h, v_new


def _recurrence_backward(fla, q, k, v, g, beta, A, scale, initial_state, do, dht, state_v_first, chunk_size, indices,
                         w, h, v_new):  # fmt: skip
    """What both rules' backwards run before their WY representation's backward, with the kernels of FLA's
    namespace ``fla``: w, h and v_new recomputed unless the forward kept them, then the state recurrence's backward
    and the gradients of q, k and w: (dq, dk, dw, dg (None for the plain rule), dv, dh0). The state recurrence and
    its backward are flame's kernels (fwd_h_triton.py, dhu_triton.py) where they serve the call, FLA's elsewhere;
    flame's dh recurrence also forms the intra-chunk dv (FLA's chunk_bwd_dv_local) where that is faster."""
    from flame.ops.gated_delta_rule import dhu_triton

    if h is None:
        gate = {} if g is None else {"g": g}  # the plain rule's recompute_w_u_fwd takes no gate
        w, u = fla.recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, **gate, **indices)
        h, v_new, _ = _state_recurrence(fla, k, state_v_first, chunk_size)(
            k=k,
            w=w,
            u=u,
            g=g,
            initial_state=initial_state,
            output_final_state=False,
            state_v_first=state_v_first,
            chunk_size=chunk_size,
            **indices,
        )
    flames_dhu = dhu_triton.serves(q, chunk_size, state_v_first)
    dh_recurrence = dhu_triton.chunk_bwd_dhu_triton if flames_dhu else fla.chunk_gated_delta_rule_bwd_dhu
    if flames_dhu and dhu_triton.forms_local_dv(q, do):
        dv = None  # its intra-chunk part formed in flame's kernel
    else:
        dv = fla.chunk_bwd_dv_local(q=q, k=k, g=g, do=do, scale=scale, chunk_size=chunk_size, **indices)
    dh, dh0, dv = dh_recurrence(
        q=q,
        k=k,
        w=w,
        g=g,
        h0=initial_state,
        dht=dht,
        do=do,
        dv=dv,
        scale=scale,
        state_v_first=state_v_first,
        chunk_size=chunk_size,
        **indices,
    )
    dq, dk, dw, dg = fla.chunk_bwd_dqkwg(
        q=q,
        k=k,
        v=v_new,
        w=w,
        g=g,
        h=h,
        dv=dv,
        do=do,
        dh=dh,
        scale=scale,
        state_v_first=state_v_first,
        chunk_size=chunk_size,
        **indices,
    )
    return dq, dk, dw, dg, dv, dh0


def _gdn_forward(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                 chunk_indices, use_gate_in_kernel, A_log, dt_bias, chunk_size, keep):  # fmt: skip
    """FLA 0.6.0's ``chunk_gated_delta_rule_fwd`` without context parallelism, its kernels in its order: (g cumsum,
    o, A, final state, w, h, v_new), the last three being what its backward recomputes unless ``keep``."""
    import fla.ops.gated_delta_rule.chunk as fla_gdn

    indices = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    if use_gate_in_kernel:
        g = fla_gdn.gdn_gate_chunk_cumsum(
            g=g, A_log=A_log, chunk_size=chunk_size, scale=fla_gdn.RCP_LN2, dt_bias=dt_bias, **indices
        )
    else:
        g = fla_gdn.chunk_local_cumsum(g, chunk_size=chunk_size, scale=fla_gdn.RCP_LN2, **indices)
    w, u, A = fla_gdn.chunk_gated_delta_rule_fwd_intra(
        k=k, v=v, g=g, beta=beta, chunk_size=chunk_size, **indices
    )
    o, final_state, h, v_new = _recurrence_forward(
        fla_gdn, q, k, w, u, g, scale,
        initial_state, output_final_state, state_v_first, chunk_size, indices, keep,
    )  # fmt: skip
    return g, o, A, final_state, w, h, v_new


def _gdn_backward(q, k, v, g, beta, A, scale, initial_state, do, dht, state_v_first, cu_seqlens, chunk_indices,
                  use_gate_in_kernel, g_input, A_log, dt_bias, chunk_size, w, h, v_new):  # fmt: skip
    """FLA 0.6.0's ``chunk_gated_delta_rule_bwd`` without context parallelism, its kernels in its order, reading
    w, h and v_new where the forward kept them (else recomputed, as FLA does): (dq, dk, dv, dbeta, dg, dh0, dA_log,
    ddt_bias)."""
    import fla.ops.gated_delta_rule.chunk as fla_gdn

    indices = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    dq, dk, dw, dg, dv, dh0 = _recurrence_backward(
        fla_gdn,
        q,
        k,
        v,
        g,
        beta,
        A,
        scale,
        initial_state,
        do,
        dht,
        state_v_first,
        chunk_size,
        indices,
        w,
        h,
        v_new,
    )
    dk2, dv, dbeta, dg2 = fla_gdn.prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=dv, **indices)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = fla_gdn.chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True, **indices)
    dA_log, ddt_bias = None, None
    if use_gate_in_kernel:
        dg, dA_log, ddt_bias = fla_gdn.gdn_gate_bwd(g=g_input, A_log=A_log, dt_bias=dt_bias, dyg=dg)
    return dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias


@torch.library.custom_op("flame::fla_gated_delta_rule_fwd", mutates_args=(), device_types="cuda")
def gated_delta_rule_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    scale: float,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    use_gate_in_kernel: bool,
    chunk_size: int,
    save_states: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, final state, q_normed, q_rstd, k_normed, k_rstd, g cumsum, sigmoid beta, A, w, h, v_new); see the module
    docstring for the empty ones. What FLA's ``ChunkGatedDeltaRuleFunction.forward`` computes and saves, and with
    ``save_states`` (calls without cu_seqlens) the state recurrence's results for the backward."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.gate import fused_beta_sigmoid_fwd

    q, k, v, g, beta, A_log, dt_bias, initial_state = _contiguous(
        q, k, v, g, beta, A_log, dt_bias, initial_state
    )
    q_normed, q_rstd, k_normed, k_rstd = q, _empty(q), k, _empty(k)
    if use_qk_l2norm_in_kernel:
        q_normed, q_rstd = l2norm_fwd(q)
        k_normed, k_rstd = l2norm_fwd(k)
    beta_act = (
        fused_beta_sigmoid_fwd(beta, 2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else beta
    )
    keep = save_states and cu_seqlens is None
    g_cumsum, o, A, final_state, w, h, v_new = _gdn_forward(
        q_normed, k_normed, v, g, beta_act, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
        _chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_size), use_gate_in_kernel, A_log, dt_bias, chunk_size, keep,
    )  # fmt: skip
    return (
        o.to(q.dtype),
        final_state if output_final_state else _empty(q),
        q_normed if use_qk_l2norm_in_kernel else _empty(q),
        q_rstd,
        k_normed if use_qk_l2norm_in_kernel else _empty(k),
        k_rstd,
        g_cumsum,
        beta_act if use_beta_sigmoid_in_kernel else _empty(beta),
        A,
        *((w, h, v_new) if keep else (_empty(k), _empty(k), _empty(v))),
    )


@gated_delta_rule_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
      use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, use_gate_in_kernel,
      chunk_size, save_states):  # fmt: skip
    batch, seq_len, num_v_heads = g.shape[:3]
    return (
        *_forward_outputs_like(
            q, k, v, cu_seqlens, output_final_state, use_qk_l2norm_in_kernel, state_v_first
        ),
        g.new_empty(batch, seq_len, num_v_heads, dtype=torch.float32),
        beta.new_empty(beta.shape, dtype=torch.float32) if use_beta_sigmoid_in_kernel else _empty(beta),
        k.new_empty(batch, seq_len, num_v_heads, chunk_size),
        *_chunk_states_like(k, v, chunk_size, state_v_first, save_states and cu_seqlens is None),
    )


@torch.library.custom_op("flame::fla_gated_delta_rule_bwd", mutates_args=(), device_types="cuda")
def gated_delta_rule_bwd(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    q_rstd: Tensor | None,
    k: Tensor,
    k_rstd: Tensor | None,
    v: Tensor,
    g: Tensor,
    g_cumsum: Tensor,
    beta: Tensor,
    beta_act: Tensor,
    A: Tensor,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    w: Tensor | None,
    h: Tensor | None,
    v_new: Tensor | None,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
    use_gate_in_kernel: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias) in the dtypes of the forward's inputs, with q, k the
    l2-normalised ones when that is on (q_rstd, k_rstd given) and g, beta the raw inputs; w, h and v_new the
    forward's where it kept them. As FLA's backward."""
    from fla.modules.norm.l2norm import l2norm_bwd
    from fla.ops.common.gate import fused_beta_sigmoid_bwd

    from flame.ops.gated_delta_rule.dqkwg_triton import serve_where_fla_refuses

    serve_where_fla_refuses()
    do, dht, q, q_rstd, k, k_rstd, v, g, g_cumsum, beta, beta_act, A, A_log, dt_bias, initial_state = (
        _contiguous(
            do, dht, q, q_rstd, k, k_rstd, v, g, g_cumsum, beta, beta_act, A, A_log, dt_bias, initial_state
        )
    )
    if h is None or h.numel() == 0:
        w = h = v_new = None
    dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias = _gdn_backward(
        q, k, v, g_cumsum, beta_act, A, scale, initial_state, do, dht, state_v_first, cu_seqlens,
        _chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_size), use_gate_in_kernel,
        g if use_gate_in_kernel else None, A_log, dt_bias, chunk_size, w, h, v_new,
    )  # fmt: skip
    if use_qk_l2norm_in_kernel:
        dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
    if use_beta_sigmoid_in_kernel:
        dbeta = fused_beta_sigmoid_bwd(beta, dbeta, 2.0 if allow_neg_eigval else 1.0)
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        dg.to(g.dtype),
        dbeta.to(beta.dtype),
        _empty(do) if dh0 is None else dh0.to(initial_state.dtype),
        _empty(do) if dA_log is None else dA_log.to(A_log.dtype),
        _empty(do) if ddt_bias is None else ddt_bias.to(dt_bias.dtype),
    )


@gated_delta_rule_bwd.register_fake
def _(do, dht, q, q_rstd, k, k_rstd, v, g, g_cumsum, beta, beta_act, A, A_log, dt_bias, initial_state, cu_seqlens,
      cu_seqlens_cpu, w, h, v_new, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
      state_v_first, use_gate_in_kernel, chunk_size):  # fmt: skip
    return tuple(
        _gradient_like(x, do)
        for x in (
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            *((A_log, dt_bias) if use_gate_in_kernel else (None, None)),
        )
    )


_GDN_NON_TENSOR_INPUTS = (
    "scale",
    "output_final_state",
    "use_qk_l2norm_in_kernel",
    "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval",
    "state_v_first",
    "use_gate_in_kernel",
    "chunk_size",
    "save_states",
)


# The flags of the backward op, in its argument order.
_BWD_FLAGS = tuple(
    name for name in _GDN_NON_TENSOR_INPUTS if name not in ("output_final_state", "save_states")
)


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, *flags = inputs
    o, final_state, q_normed, q_rstd, k_normed, k_rstd, g_cumsum, beta_act, A, w, h, v_new = output
    ctx.flags = dict(zip(_GDN_NON_TENSOR_INPUTS, flags, strict=True))
    l2norm = ctx.flags["use_qk_l2norm_in_kernel"]
    ctx.save_for_backward(
        q_normed if l2norm else q,
        q_rstd if l2norm else None,
        k_normed if l2norm else k,
        k_rstd if l2norm else None,
        v,
        g,
        g_cumsum,
        beta,
        beta_act if ctx.flags["use_beta_sigmoid_in_kernel"] else beta,
        A,
        A_log,
        dt_bias,
        initial_state,
        cu_seqlens,
        cu_seqlens_cpu,
        w,
        h,
        v_new,
    )
    ctx.has_initial_state = initial_state is not None
    ctx.has_dt_bias = dt_bias is not None
    ctx.set_materialize_grads(
        False
    )  # no zero-filled gradients for the outputs that have none (h: 0.4 GB at 340M)
    ctx.mark_non_differentiable(q_normed, q_rstd, k_normed, k_rstd, g_cumsum, beta_act, A, w, h, v_new)
    if not ctx.flags["output_final_state"]:
        ctx.mark_non_differentiable(final_state)


def _gdn_autograd_backward(ctx, do, dht, *_unused_grads):
    flags = ctx.flags
    if do is None:  # only the final state's gradient arrived
        q, v = ctx.saved_tensors[0], ctx.saved_tensors[4]
        do = torch.zeros_like(v, dtype=q.dtype)
    # The saved tensors are in the order of the backward op's arguments after (do, dht).
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = gated_delta_rule_bwd(
        do,
        dht if flags["output_final_state"] else None,
        *ctx.saved_tensors,
        *(flags[name] for name in _BWD_FLAGS),
    )
    gate = flags["use_gate_in_kernel"]
    return (
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dA_log if gate else None,
        ddt_bias if gate and ctx.has_dt_bias else None,
        dh0 if ctx.has_initial_state else None,
        *([None] * (2 + len(_GDN_NON_TENSOR_INPUTS))),
    )


gated_delta_rule_fwd.register_autograd(_gdn_autograd_backward, setup_context=_gdn_setup_context)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    cp_context=None,
    *,
    chunk_size: int = 64,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """FLA's ``chunk_gated_delta_rule`` (same arguments and results) through the custom ops. ``chunk_indices`` is
    recomputed from ``cu_seqlens`` (FLA caches it per tensor); context parallelism (``cp_context``) is FLA's own
    op's, which the dispatcher calls instead."""
    if cp_context is not None:
        raise ValueError("cp_context needs FLA's own chunk_gated_delta_rule, not the custom ops")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final_state, *_ = gated_delta_rule_fwd(
        q, k, v, g, beta, A_log if use_gate_in_kernel else None, dt_bias if use_gate_in_kernel else None,
        initial_state, cu_seqlens, cu_seqlens_cpu, float(scale), output_final_state, use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, use_gate_in_kernel, chunk_size,
        saves_chunk_states(),
    )  # fmt: skip
    return o, final_state if output_final_state else None


def _delta_forward(
    q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices, chunk_size, keep
):
    """FLA 0.6.0's ``chunk_delta_rule_fwd``, its kernels in its order: (o, A, final state, w, h, v_new), the last
    three being what its backward recomputes unless ``keep``."""
    import fla.ops.delta_rule.chunk as fla_delta

    indices = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    w, u, A = fla_delta.prepare_wy_repr_fwd(k=k, v=v, beta=beta, chunk_size=chunk_size, **indices)
    o, final_state, h, v_new = _recurrence_forward(
        fla_delta, q, k, w, u, None, scale,
        initial_state, output_final_state, False, chunk_size, indices, keep,
    )  # fmt: skip
    return o, A, final_state, w, h, v_new


def _delta_backward(q, k, v, beta, A, scale, initial_state, do, dht, cu_seqlens, chunk_indices, chunk_size, w, h,
                    v_new):  # fmt: skip
    """FLA 0.6.0's ``chunk_delta_rule_bwd``, its kernels in its order, reading w, h and v_new where the forward
    kept them (else recomputed, as FLA does): (dq, dk, dv, dbeta, dh0)."""
    import fla.ops.delta_rule.chunk as fla_delta

    indices = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    dq, dk, dw, _, dv, dh0 = _recurrence_backward(
        fla_delta,
        q,
        k,
        v,
        None,
        beta,
        A,
        scale,
        initial_state,
        do,
        dht,
        False,
        chunk_size,
        indices,
        w,
        h,
        v_new,
    )
    dk2, dv, dbeta = fla_delta.prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=A, dw=dw, du=dv, **indices)
    dk.add_(dk2)
    return dq, dk, dv, dbeta, dh0


@torch.library.custom_op("flame::fla_delta_rule_fwd", mutates_args=(), device_types="cuda")
def delta_rule_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    scale: float,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    chunk_size: int,
    save_states: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, final state, q_normed, q_rstd, k_normed, k_rstd, A, w, h, v_new); see the module docstring for the empty
    ones. What FLA's ``ChunkDeltaRuleFunction.forward`` computes and saves, and with ``save_states`` (calls without
    cu_seqlens) the state recurrence's results for the backward."""
    from fla.modules.norm.l2norm import l2norm_fwd

    q, k, v, beta, initial_state = _contiguous(q, k, v, beta, initial_state)
    q_normed, q_rstd, k_normed, k_rstd = q, _empty(q), k, _empty(k)
    if use_qk_l2norm_in_kernel:
        q_normed, q_rstd = l2norm_fwd(q)
        k_normed, k_rstd = l2norm_fwd(k)
    keep = save_states and cu_seqlens is None
    o, A, final_state, w, h, v_new = _delta_forward(
        q_normed, k_normed, v, beta, scale, initial_state, output_final_state, cu_seqlens,
        _chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_size), chunk_size, keep,
    )  # fmt: skip
    return (
        o.to(q.dtype),
        final_state if output_final_state else _empty(q),
        q_normed if use_qk_l2norm_in_kernel else _empty(q),
        q_rstd,
        k_normed if use_qk_l2norm_in_kernel else _empty(k),
        k_rstd,
        A,
        *((w, h, v_new) if keep else (_empty(k), _empty(k), _empty(v))),
    )


@delta_rule_fwd.register_fake
def _(q, k, v, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state, use_qk_l2norm_in_kernel,
      chunk_size, save_states):  # fmt: skip
    batch, seq_len, num_heads = k.shape[:3]
    return (
        *_forward_outputs_like(q, k, v, cu_seqlens, output_final_state, use_qk_l2norm_in_kernel, False),
        k.new_empty(batch, seq_len, num_heads, chunk_size),
        *_chunk_states_like(k, v, chunk_size, False, save_states and cu_seqlens is None),
    )


@torch.library.custom_op("flame::fla_delta_rule_bwd", mutates_args=(), device_types="cuda")
def delta_rule_bwd(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    q_rstd: Tensor | None,
    k: Tensor,
    k_rstd: Tensor | None,
    v: Tensor,
    beta: Tensor,
    A: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    w: Tensor | None,
    h: Tensor | None,
    v_new: Tensor | None,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbeta, dh0) in the dtypes of the forward's inputs, with q, k the l2-normalised ones when that is
    on (q_rstd, k_rstd given); w, h and v_new the forward's where it kept them. As FLA's backward."""
    from fla.modules.norm.l2norm import l2norm_bwd

    do, dht, q, q_rstd, k, k_rstd, v, beta, A, initial_state = _contiguous(
        do, dht, q, q_rstd, k, k_rstd, v, beta, A, initial_state
    )
    if h is None or h.numel() == 0:
        w = h = v_new = None
    dq, dk, dv, dbeta, dh0 = _delta_backward(
        q, k, v, beta, A, scale, initial_state, do, dht, cu_seqlens,
        _chunk_indices(cu_seqlens, cu_seqlens_cpu, chunk_size), chunk_size, w, h, v_new,
    )  # fmt: skip
    if use_qk_l2norm_in_kernel:
        dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        dbeta.to(beta.dtype),
        _empty(do) if dh0 is None else dh0.to(initial_state.dtype),
    )


@delta_rule_bwd.register_fake
def _(do, dht, q, q_rstd, k, k_rstd, v, beta, A, initial_state, cu_seqlens, cu_seqlens_cpu, w, h, v_new, scale,
      use_qk_l2norm_in_kernel, chunk_size):  # fmt: skip
    return tuple(_gradient_like(x, do) for x in (q, k, v, beta, initial_state))


_DELTA_NON_TENSOR_INPUTS = (
    "scale",
    "output_final_state",
    "use_qk_l2norm_in_kernel",
    "chunk_size",
    "save_states",
)


def _delta_setup_context(ctx, inputs, output):
    q, k, v, beta, initial_state, cu_seqlens, cu_seqlens_cpu, *flags = inputs
    o, final_state, q_normed, q_rstd, k_normed, k_rstd, A, w, h, v_new = output
    ctx.flags = dict(zip(_DELTA_NON_TENSOR_INPUTS, flags, strict=True))
    l2norm = ctx.flags["use_qk_l2norm_in_kernel"]
    ctx.save_for_backward(
        q_normed if l2norm else q,
        q_rstd if l2norm else None,
        k_normed if l2norm else k,
        k_rstd if l2norm else None,
        v,
        beta,
        A,
        initial_state,
        cu_seqlens,
        cu_seqlens_cpu,
        w,
        h,
        v_new,
    )
    ctx.has_initial_state = initial_state is not None
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(q_normed, q_rstd, k_normed, k_rstd, A, w, h, v_new)
    if not ctx.flags["output_final_state"]:
        ctx.mark_non_differentiable(final_state)


def _delta_autograd_backward(ctx, do, dht, *_unused_grads):
    flags = ctx.flags
    if do is None:  # only the final state's gradient arrived
        q, v = ctx.saved_tensors[0], ctx.saved_tensors[4]
        do = torch.zeros_like(v, dtype=q.dtype)
    # The saved tensors are in the order of the backward op's arguments after (do, dht).
    dq, dk, dv, dbeta, dh0 = delta_rule_bwd(
        do,
        dht if flags["output_final_state"] else None,
        *ctx.saved_tensors,
        flags["scale"],
        flags["use_qk_l2norm_in_kernel"],
        flags["chunk_size"],
    )
    return (
        dq,
        dk,
        dv,
        dbeta,
        dh0 if ctx.has_initial_state else None,
        *([None] * (2 + len(_DELTA_NON_TENSOR_INPUTS))),
    )


delta_rule_fwd.register_autograd(_delta_autograd_backward, setup_context=_delta_setup_context)


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """FLA's ``chunk_delta_rule`` (same arguments and results) through the custom ops."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final_state, *_ = delta_rule_fwd(
        q, k, v, beta, initial_state, cu_seqlens, cu_seqlens_cpu, float(scale), output_final_state,
        use_qk_l2norm_in_kernel, chunk_size, saves_chunk_states(),
    )  # fmt: skip
    return o, final_state if output_final_state else None


@torch.library.custom_op("flame::fla_simple_gla_fwd", mutates_args=(), device_types="cuda")
def simple_gla_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, state_v_first: bool, chunk_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(o, final state, g cumsum): what FLA's ``ChunkSimpleGLAFunction.forward`` computes and saves for a scalar
    log decay g per head and token [B, T, H], without an initial state or packed documents, the final state
    always returned (Mamba-2's scan, flame.ops.ssd, keeps it for a prompt's cache)."""
    import fla.ops.simple_gla.chunk as fla_simple_gla

    q, k, v, g = _contiguous(q, k, v, g)
    g_cumsum = fla_simple_gla.chunk_local_cumsum(g, chunk_size=chunk_size, scale=fla_simple_gla.RCP_LN2)
    o, final_state = fla_simple_gla.chunk_simple_gla_fwd(
        q=q,
        k=k,
        v=v,
        g=g_cumsum,
        g_gamma=None,
        scale=scale,
        initial_state=None,
        output_final_state=True,
        state_v_first=state_v_first,
        chunk_size=chunk_size,
    )
    return o.to(q.dtype), final_state, g_cumsum


@simple_gla_fwd.register_fake
def _(q, k, v, g, scale, state_v_first, chunk_size):
    batch, _, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    return (
        q.new_empty(*v.shape),
        k.new_empty(batch, heads, *state_shape, dtype=torch.float32),
        g.new_empty(g.shape, dtype=torch.float32),
    )


@torch.library.custom_op("flame::fla_simple_gla_bwd", mutates_args=(), device_types="cuda")
def simple_gla_bwd(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_cumsum: Tensor,
    scale: float,
    state_v_first: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg), dg in float32: FLA's ``ChunkSimpleGLAFunction.backward``, its dq/dk/dg served on Hopper by
    flame's kernel or FLA's TileLang one where FLA refuses it (FLA issue 640)."""
    import fla.ops.simple_gla.chunk as fla_simple_gla

    from flame.ops.gated_delta_rule.dqkwg_triton import serve_where_fla_refuses

    serve_where_fla_refuses()
    do, dht, q, k, v, g_cumsum = _contiguous(do, dht, q, k, v, g_cumsum)
    dq, dk, dv, dg, _ = fla_simple_gla.chunk_simple_gla_bwd(
        q=q,
        k=k,
        v=v,
        g=g_cumsum,
        g_gamma=None,
        initial_state=None,
        do=do,
        dht=dht,
        scale=scale,
        state_v_first=state_v_first,
        chunk_size=chunk_size,
    )
    dg = fla_simple_gla.chunk_local_cumsum(dg, chunk_size=chunk_size, reverse=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.float()


@simple_gla_bwd.register_fake
def _(do, dht, q, k, v, g_cumsum, scale, state_v_first, chunk_size):
    return (
        *(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)),
        torch.empty_like(g_cumsum, dtype=torch.float32, memory_format=torch.contiguous_format),
    )


def _simple_gla_setup_context(ctx, inputs, output):
    q, k, v, g, scale, state_v_first, chunk_size = inputs
    ctx.save_for_backward(q, k, v, output[2])
    ctx.flags = (scale, state_v_first, chunk_size)
    ctx.g_dtype = g.dtype
    ctx.set_materialize_grads(False)  # no zero-filled final-state gradient where the state is not used
    ctx.mark_non_differentiable(output[2])


def _simple_gla_autograd_backward(ctx, do, dht, _g_cumsum_grad):
    q, k, v, g_cumsum = ctx.saved_tensors
    if do is None:  # only the final state's gradient arrived
        do = torch.zeros_like(v, dtype=q.dtype)
    dq, dk, dv, dg = simple_gla_bwd(do, dht, q, k, v, g_cumsum, *ctx.flags)
    return dq, dk, dv, dg.to(ctx.g_dtype), None, None, None


simple_gla_fwd.register_autograd(_simple_gla_autograd_backward, setup_context=_simple_gla_setup_context)


def chunk_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float,
    state_v_first: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """FLA's ``chunk_simple_gla`` with a per-token g and ``output_final_state`` (no g_gamma, initial state or
    cu_seqlens) through the custom ops: (o in q's dtype, the final state in float32)."""
    o, final_state, _ = simple_gla_fwd(q, k, v, g, float(scale), state_v_first, chunk_size)
    return o, final_state
