"""Chunked gated delta rule in pure PyTorch: the CPU path, differentiable by autograd.

Same recurrence as `naive.py` (read its docstring for the update rule, layouts and head grouping), computed chunk by
chunk with the WY / UT-transform formulation of Gated DeltaNet (Yang, Kautz & Hatamizadeh, arXiv 2412.06464, Sec. 3;
the same idea as FLA's kernels and its `naive_chunk_gated_delta_rule`). This is our own derivation:

Inside a chunk of C tokens starting from state S0, let gamma_i = g_1 + ... + g_i (cumulative log decay from the chunk
start) and Gamma_ij = exp(gamma_i - gamma_j) for j <= i, else 0. Unrolling the recurrence, the corrected values u_i
satisfy

    u_i = beta_i * (v_i - exp(gamma_i) S0^T k_i - sum_{j<i} Gamma_ij (k_i . k_j) u_j),

a unit lower-triangular system (I + A) U = beta V - (beta exp(gamma) K) S0 with A_ij = beta_i Gamma_ij (k_i . k_j),
j < i. Solving it once per chunk (triangular solve, no dependence on S0) gives

    U = U_intra - W S0,   U_intra = (I + A)^{-1} beta V,   W = (I + A)^{-1} beta exp(gamma) K,

after which everything is matrix products:

    O   = scale * ( exp(gamma) Q S0 + (Q K^T * Gamma) U )
    S_C = exp(gamma_C) S0 + (exp(gamma_C - gamma) K)^T U.

Only the state hand-off between chunks is sequential. A sequence whose length is not a multiple of C is padded at
the end with k = v = beta = g = 0 tokens, which leave the state unchanged. Packed documents (`cu_seqlens`) are run
as a zero-padded batch of documents. Computation is in float32 for half-precision inputs, else in the input dtype.
"""

import torch
import torch.nn.functional as F

from flame.ops.varlen import pad_documents, unpad_documents


def _chunked_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-length sequences [B, T, ...] -> (o [B, T, HV, V] in the compute dtype, final state [B, HV, K, V])."""
    batch, seq_len, num_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    group = num_value_heads // num_heads

    # [B, HV, T, D] (value-head-major), with q/k repeated over the value heads they serve.
    q = q.to(compute_dtype).repeat_interleave(group, dim=2).transpose(1, 2) * scale
    k = k.to(compute_dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    v = v.to(compute_dtype).transpose(1, 2)
    beta = beta.to(compute_dtype).transpose(1, 2)
    g = beta.new_zeros(beta.shape) if g is None else g.to(compute_dtype).transpose(1, 2)

    padding = -seq_len % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, padding)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, padding)) for x in (beta, g))
    num_chunks = (seq_len + padding) // chunk_size
    q, k, v = (x.reshape(batch, num_value_heads, num_chunks, chunk_size, -1) for x in (q, k, v))
    beta, g = (x.reshape(batch, num_value_heads, num_chunks, chunk_size) for x in (beta, g))

    gamma = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # Mask before exp: above the diagonal gamma_i - gamma_j > 0 and could overflow.
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    strictly_causal = causal.tril(-1)
    a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strictly_causal, 0.0)
    identity = torch.eye(chunk_size, dtype=compute_dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * gamma.exp())[..., None] * k], dim=-1)
    solution = torch.linalg.solve_triangular(identity + a, rhs, upper=False, unitriangular=True)
    u_intra, w = solution.split([value_dim, key_dim], dim=-1)

    intra_chunk_scores = (q @ k.transpose(-1, -2)) * decay
    q_from_chunk_start = q * gamma.exp()[..., None]
    k_to_chunk_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    if initial_state is None:
        state = q.new_zeros(batch, num_value_heads, key_dim, value_dim)
    else:
        state = initial_state.to(compute_dtype)
    outputs = []
    for c in range(num_chunks):
        u = u_intra[:, :, c] - w[:, :, c] @ state
        outputs.append(q_from_chunk_start[:, :, c] @ state + intra_chunk_scores[:, :, c] @ u)
        state = chunk_decay[:, :, c] * state + k_to_chunk_end[:, :, c].transpose(-1, -2) @ u

    o = torch.stack(outputs, dim=2).reshape(batch, num_value_heads, num_chunks * chunk_size, value_dim)
    return o[:, :, :seq_len].transpose(1, 2), state


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule; same arguments and results as `naive_recurrent_gated_delta_rule`.

    `chunk_size` only trades speed for memory (any positive size gives the same result up to rounding).
    Returns (o [B, T, HV, V] in q.dtype, final state [N, HV, K, V] in the compute dtype, or None).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is None:
        o, final_state = _chunked_recurrence(q, k, v, g, beta, scale, initial_state, chunk_size)
    else:
        q, k, v, beta = (pad_documents(x, cu_seqlens) for x in (q, k, v, beta))
        g = None if g is None else pad_documents(g, cu_seqlens)
        o, final_state = _chunked_recurrence(q, k, v, g, beta, scale, initial_state, chunk_size)
        o = unpad_documents(o, cu_seqlens)
    return o.to(q.dtype), final_state if output_final_state else None
