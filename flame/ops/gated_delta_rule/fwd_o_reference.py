"""The PyTorch reference of FLA's ``chunk_fwd_o`` (the output of the (gated) delta rule's chunked forward), which
flame's Triton kernel of the forward's state recurrence and output in one pass (fwd_o_triton.py) is tested against
together with the state recurrence's reference (fwd_h_reference.py).

Per chunk c of a sequence and value head, with the state h_c at the chunk's start, the new values v_new_c, the
token-local cumulative log2-decay g (none for the plain delta rule) and i, j tokens of the chunk:

    o_c = scale * (2^g * (q_c h_c) + M v_new_c),   M[i, j] = (q_i . k_j) 2^(g_i - g_j) for j <= i, else 0
"""

import torch

from flame.ops.gated_delta_rule.dqkwg_triton import chunk_bounds
from flame.ops.gated_delta_rule.fwd_h_reference import chunk_fwd_h_torch


def chunk_fwd_o_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    h: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """o like v, as FLA's function: q, k [B, T, H, K]; v (the new values) [B, T, HV, V]; h the chunk states in FLA's
    layout ([B, chunks, HV, K, V], or [1, all chunks, ...] packed; [.., V, K] with ``state_v_first``)."""
    batch, seq_len, num_heads, _ = q.shape
    num_v_heads = v.shape[2]
    group = num_v_heads // num_heads
    starts, ends = chunk_bounds(batch, seq_len, chunk_size, cu_seqlens, q.device)
    q_flat, k_flat, v_flat = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    states = h.flatten(0, 1)
    o = torch.empty_like(v_flat)
    for chunk, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        for head in range(num_v_heads):
            q_c, k_c = q_flat[s:e, head // group], k_flat[s:e, head // group]
            state = states[chunk, head].transpose(0, 1) if state_v_first else states[chunk, head]
            inter, scores = q_c @ state, (q_c @ k_c.T).tril()
            if g is not None:
                g_c = g.flatten(0, 1)[s:e, head].to(q.dtype)
                inter = inter * torch.exp2(g_c)[:, None]
                scores = scores * torch.exp2(g_c[:, None] - g_c[None, :]).tril()
            o[s:e, head] = scale * (inter + scores @ v_flat[s:e, head])
    return o.view_as(v)


def chunk_fwd_ho_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, final state) of the state recurrence followed by the output: what fwd_o_triton's kernel computes."""
    h, v_new, final_state = chunk_fwd_h_torch(
        k, w, u, g, initial_state, output_final_state, state_v_first, cu_seqlens, chunk_size
    )
    o = chunk_fwd_o_torch(q, k, v_new, h, g, scale, state_v_first, cu_seqlens, chunk_size)
    return o, final_state
