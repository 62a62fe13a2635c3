"""The PyTorch reference of FLA's gated ``chunk_bwd_dqkwg``, which flame's Triton kernel (dqkwg_triton.py) is tested
against.

The kernel exists for FLA issue 640 (PR 826): Triton >= 3.4, < 3.7.1 miscompiles ``tl.trans`` of a wgmma-layout
accumulator in FLA's gated ``chunk_bwd_kernel_dqkwg`` on Hopper, so FLA 0.6.0 raises there instead of returning wrong
gradients, and flame.compat serves that function with flame's kernel through FLA's backend registry.

`chunk_bwd_dqkwg_torch` computes the same per-chunk quantities with batched PyTorch matmuls.

Per chunk c with token-local cumulative log2-decay g (FLA's convention), start state h_c, gradient dh of the
state after the chunk, output gradient do and (for the delta rule) gradient dv of v_new = u - w h_c:

    dq_t = scale * (2^{g_t} do_t h_c^T + sum_{s<=t} (do_t . v_s) 2^{g_t - g_s} k_s)
    dk_s = 2^{g_last - g_s} v_s dh^T + scale * sum_{t>=s} (do_t . v_s) 2^{g_t - g_s} q_t
    dw_t = -dv_t h_c^T
    dg_t = q_t . dq_t - k_t . dk_t  (+ 2^{g_last} <h_c, dh> + sum_s k_s . dk_s^{state} at the chunk's last token)

dg is returned before FLA's reverse cumulative sum, exactly as the Triton kernel returns it.
"""

import torch

from flame.ops.gated_delta_rule.dqkwg_triton import chunk_bounds


def _chunk_token_index(
    batch: int, seq_len: int, chunk_size: int, cu_seqlens: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, chunk_size] flat token indices of every chunk (in FLA's chunk order) and their validity mask."""
    chunk_start, chunk_end = chunk_bounds(batch, seq_len, chunk_size, cu_seqlens, device)
    index = chunk_start[:, None] + torch.arange(chunk_size, device=device)
    valid = index < chunk_end[:, None]
    return torch.where(valid, index, 0), valid


def chunk_bwd_dqkwg_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Same arguments and results as ``fla.ops.common.chunk_o.chunk_bwd_dqkwg`` for the gated case."""
    if g is None or g_gamma is not None:
        raise ValueError("chunk_bwd_dqkwg_torch serves the gated case only (g given, no g_gamma)")
    batch, seq_len, num_heads, key_dim = q.shape
    num_v_heads = v.shape[2]
    group = num_v_heads // num_heads
    index, valid = _chunk_token_index(batch, seq_len, chunk_size, cu_seqlens, q.device)
    num_chunks = index.shape[0]
    f32 = torch.promote_types(q.dtype, torch.float32)  # float32 for half inputs, float64 stays float64

    def gather(x: torch.Tensor) -> torch.Tensor:  # [B, T, heads, d] -> [N, BT, heads, d], zero where invalid
        x = x.reshape(batch * seq_len, *x.shape[2:])[index].to(f32)
        return x * valid.view(*valid.shape, *([1] * (x.dim() - 2)))

    q_c = gather(q).repeat_interleave(group, dim=2)  # value head i uses query/key head i // group
    k_c = gather(k).repeat_interleave(group, dim=2)
    v_c, do_c = gather(v), gather(do)
    g_c = gather(g.unsqueeze(-1)).squeeze(-1)  # [N, BT, HV]
    h_c = h.reshape(num_chunks, num_v_heads, *h.shape[-2:]).to(f32)
    dh_c = dh.reshape(num_chunks, num_v_heads, *dh.shape[-2:]).to(f32)
    if state_v_first:  # stored [V, K]: work with [K, V]
        h_c, dh_c = h_c.transpose(-1, -2), dh_c.transpose(-1, -2)

    last = valid.sum(1) - 1  # position of each chunk's last token
    g_last = g_c[torch.arange(num_chunks, device=q.device), last]  # [N, HV]
    decay = torch.exp2(g_c)  # [N, BT, HV]
    decay_to_end = torch.where(valid[..., None], torch.exp2(g_last[:, None] - g_c), 0.0)

    dq = torch.einsum("ntgv,ngkv->ntgk", do_c, h_c) * decay[..., None] * scale
    dk = torch.einsum("ntgv,ngkv->ntgk", v_c, dh_c) * decay_to_end[..., None]
    dg_last = torch.einsum("ngkv,ngkv->ng", h_c, dh_c) * torch.exp2(g_last) + torch.einsum(
        "ntgk,ntgk->ng", dk, k_c
    )

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_valid = causal & valid[:, :, None] & valid[:, None, :]  # [N, t, s]
    ds = torch.einsum("ntgv,nsgv->ngts", do_c, v_c)
    relative_decay = torch.exp2(g_c.transpose(1, 2)[..., :, None] - g_c.transpose(1, 2)[..., None, :])
    ds = torch.where(pair_valid[:, None], ds * relative_decay, 0.0) * scale
    dq = dq + torch.einsum("ngts,nsgk->ntgk", ds, k_c)
    dk = dk + torch.einsum("ngts,ntgk->nsgk", ds, q_c)

    dg = (dq * q_c).sum(-1) - (dk * k_c).sum(-1)  # [N, BT, HV]
    dg[torch.arange(num_chunks, device=q.device), last] += dg_last

    def scatter(x: torch.Tensor, like_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(batch * seq_len, *x.shape[2:], dtype=f32, device=q.device)
        out[index[valid]] = x[valid]
        return out.view(*like_shape).to(dtype)

    dq = scatter(dq, (batch, seq_len, num_v_heads, key_dim), q.dtype)
    dk = scatter(dk, (batch, seq_len, num_v_heads, key_dim), k.dtype)
    if group > 1:  # a query/key head collects the gradients of all the value heads it serves
        dq = dq.view(batch, seq_len, num_heads, group, key_dim).sum(3)
        dk = dk.view(batch, seq_len, num_heads, group, key_dim).sum(3)
    dw = None
    if w is not None:
        dw_c = -torch.einsum("ntgv,ngkv->ntgk", gather(dv), h_c)
        dw = scatter(dw_c, tuple(w.shape), w.dtype)
    dg = scatter(
        dg.unsqueeze(-1), tuple(g.shape) + (1,), torch.promote_types(g.dtype, torch.float32)
    ).squeeze(-1)
    return dq, dk, dw, dg
