"""The PyTorch reference of FLA's ``chunk_gated_delta_rule_bwd_dhu`` (the dh recurrence), which flame's Triton kernel
(dhu_triton.py) is tested against.

Per sequence and value head, over its chunks from the last to the first, with token-local cumulative log2-decay g
(FLA's convention; none for the plain delta rule), key/query head i of the value head, state gradient dh (the
final state's gradient dht, or zero, before the last chunk):

    dh_c = dh                                          (stored: the gradient of the state at chunk c's start)
    dv2_c = 2^(g_last - g) * (k_c dh) + dv_c           (dv the intra-chunk part, chunk_bwd_dv_local's)
    dh = 2^g_last * dh + scale * (2^g * q_c)^T do_c - w_c^T dv2_c

and dh0 = dh after the first chunk. States are [K, V], or [V, K] with ``state_v_first``. The intra-chunk part,
FLA's ``chunk_bwd_dv_local``, of token i of a chunk over its tokens j >= i:

    dv_i = sum_j scale * (k_i . q_j) * 2^(g_j - g_i) * do_j
"""

import torch

from flame.ops.gated_delta_rule.dqkwg_triton import chunk_bounds


def chunk_bwd_dv_local_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    do: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """FLA's ``chunk_bwd_dv_local``: dv like do, the arithmetic in q's dtype."""
    batch, seq_len, num_heads, key_dim = q.shape
    num_v_heads = do.shape[2]
    group = num_v_heads // num_heads
    scale = key_dim**-0.5 if scale is None else scale
    starts, ends = chunk_bounds(batch, seq_len, chunk_size, cu_seqlens, q.device)
    q_flat, k_flat = (x.flatten(0, 1).repeat_interleave(group, dim=1) for x in (q, k))  # per value head
    do_flat = do.flatten(0, 1)
    g_flat = g.flatten(0, 1).to(q.dtype) if g is not None else None
    dv = torch.zeros_like(do_flat)
    for s, e in zip(starts.tolist(), ends.tolist()):
        upper = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu()  # key i, query j >= i
        scores = scale * torch.einsum("ihk,jhk->hij", k_flat[s:e], q_flat[s:e])
        if g_flat is not None:
            g_c = g_flat[s:e].T  # [HV, tokens]
            scores = scores * torch.exp2(torch.where(upper, g_c[:, None, :] - g_c[:, :, None], 0.0))
        dv[s:e] = torch.einsum("hij,jhv->ihv", torch.where(upper, scores, 0.0), do_flat[s:e])
    return dv.view_as(do)


def chunk_bwd_dhu_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    do: torch.Tensor,
    dv: torch.Tensor | None,
    g: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dh [B, chunks, HV, K, V] in q's dtype, dh0 in float32 where h0 is given, dv2 like do), as FLA's function;
    the arithmetic in q's dtype (float64 for a float64 reference). dv None: the intra-chunk part computed here
    (chunk_bwd_dv_local_torch), as flame's kernel computes it without dv."""
    if dv is None:
        dv = chunk_bwd_dv_local_torch(q, k, do, g, scale, cu_seqlens, chunk_size)
    batch, seq_len, num_heads, key_dim = q.shape
    num_v_heads, value_dim = do.shape[2], do.shape[3]
    group = num_v_heads // num_heads
    scale = key_dim**-0.5 if scale is None else scale
    starts, ends = chunk_bounds(batch, seq_len, chunk_size, cu_seqlens, q.device)
    starts, ends = starts.tolist(), ends.tolist()
    flat = {name: x.flatten(0, 1) for name, x in dict(q=q, k=k, w=w, do=do, dv=dv).items()}
    g_flat = None if g is None else g.flatten(0, 1)
    sequences = (
        [(row * seq_len, (row + 1) * seq_len) for row in range(batch)]
        if cu_seqlens is None
        else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    )
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    rows = batch if cu_seqlens is None else 1  # FLA's layout: [B, chunks per row] or, packed, [1, all chunks]
    dh = q.new_zeros(rows, len(starts) // rows, num_v_heads, *state_shape)
    dh_chunks = dh.view(len(starts), num_v_heads, *state_shape)
    dv2 = torch.empty_like(flat["dv"])
    dh0 = None if h0 is None else torch.empty(h0.shape, dtype=torch.float32, device=q.device)

    def as_kv(state: torch.Tensor) -> torch.Tensor:
        return state.transpose(-1, -2) if state_v_first else state

    for sequence, (bos, eos) in enumerate(sequences):
        chunks = [c for c, s in enumerate(starts) if bos <= s < eos]
        for head in range(num_v_heads):
            i_h = head // group
            state = (
                as_kv(dht[sequence, head]).to(q.dtype) if dht is not None else q.new_zeros(key_dim, value_dim)
            )
            for chunk in reversed(chunks):
                s, e = starts[chunk], ends[chunk]
                dh_chunks[chunk, head] = as_kv(state)
                k_c, q_c = flat["k"][s:e, i_h], flat["q"][s:e, i_h]
                dv_c = k_c @ state
                if g_flat is not None:
                    g_c = g_flat[s:e, head].to(q.dtype)
                    dv_c = dv_c * torch.exp2(g_c[-1] - g_c)[:, None]
                    state = state * torch.exp2(g_c[-1])
                    q_c = q_c * torch.exp2(g_c)[:, None]
                dv_c = dv_c + flat["dv"][s:e, head]
                dv2[s:e, head] = dv_c
                state = state + scale * q_c.T @ flat["do"][s:e, head] - flat["w"][s:e, head].T @ dv_c
            if dh0 is not None:
                dh0[sequence, head] = as_kv(state).float()
    return dh, dh0, dv2.view_as(dv)
