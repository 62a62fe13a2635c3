"""The PyTorch reference of FLA's ``chunk_gated_delta_rule_fwd_h`` (the state recurrence of the (gated) delta rule's
chunked forward), which flame's Triton kernel (fwd_h_triton.py) is tested against.

Per sequence and value head, over its chunks from the first to the last, with token-local cumulative log2-decay g
(FLA's convention; none for the plain delta rule), key head i of the value head, state h (the initial state, or
zero, before the first chunk):

    h_c = h                                            (stored: the state at chunk c's start)
    v_new_c = u_c - w_c h                              (stored before the decay)
    h = 2^g_last * h + k_c^T (2^(g_last - g) * v_new_c)

and the final state is h after the last chunk. States are [K, V], or [V, K] with ``state_v_first``.
"""

import torch

from flame.ops.gated_delta_rule.dqkwg_triton import chunk_bounds


def chunk_fwd_h_torch(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(h [B, chunks, HV, K, V] in k's dtype, v_new like u, the final state where asked in float32 (float64 for
    float64 inputs)), as FLA's function; the arithmetic in k's dtype (float64 for a float64 reference)."""
    batch, seq_len, num_heads, key_dim = k.shape
    num_v_heads, value_dim = u.shape[2], u.shape[3]
    group = num_v_heads // num_heads
    starts, ends = chunk_bounds(batch, seq_len, chunk_size, cu_seqlens, k.device)
    starts, ends = starts.tolist(), ends.tolist()
    flat = {name: x.flatten(0, 1) for name, x in dict(k=k, w=w, u=u).items()}
    g_flat = None if g is None else g.flatten(0, 1)
    sequences = (
        [(row * seq_len, (row + 1) * seq_len) for row in range(batch)]
        if cu_seqlens is None
        else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    )
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    rows = batch if cu_seqlens is None else 1  # FLA's layout: [B, chunks per row] or, packed, [1, all chunks]
    h = k.new_zeros(rows, len(starts) // rows, num_v_heads, *state_shape)
    h_chunks = h.view(len(starts), num_v_heads, *state_shape)
    v_new = torch.empty_like(flat["u"])
    final_state = None
    if output_final_state:
        final_state = torch.empty(
            len(sequences), num_v_heads, *state_shape, dtype=torch.float32, device=k.device
        )
        if k.dtype == torch.float64:
            final_state = final_state.double()

    def as_kv(state: torch.Tensor) -> torch.Tensor:
        return state.transpose(-1, -2) if state_v_first else state

    for sequence, (bos, eos) in enumerate(sequences):
        chunks = [c for c, s in enumerate(starts) if bos <= s < eos]
        for head in range(num_v_heads):
            i_h = head // group
            state = (
                as_kv(initial_state[sequence, head]).to(k.dtype)
                if initial_state is not None
                else k.new_zeros(key_dim, value_dim)
            )
            for chunk in chunks:
                s, e = starts[chunk], ends[chunk]
                h_chunks[chunk, head] = as_kv(state)
                v_c = flat["u"][s:e, head] - flat["w"][s:e, head] @ state
                v_new[s:e, head] = v_c
                if g_flat is not None:
                    g_c = g_flat[s:e, head].to(k.dtype)
                    v_c = v_c * torch.exp2(g_c[-1] - g_c)[:, None]
                    state = state * torch.exp2(g_c[-1])
                state = state + flat["k"][s:e, i_h].T @ v_c
            if final_state is not None:
                final_state[sequence, head] = as_kv(state)
    return h, v_new.view_as(u), final_state
