"""A Triton gated ``chunk_bwd_dqkwg`` that Triton 3.4-3.7.0 compiles correctly on Hopper (flame's kernel).

FLA issue 640: those Triton versions miscompile ``tl.trans`` of a wgmma-layout accumulator on Hopper, and FLA's
kernel transposes the chunk's score-gradient tile ds (an accumulator) to form dk. This kernel never transposes an
accumulator: it accumulates ds = do v^T and its transpose ds^T = v do^T as two separate products of loaded tiles
(one extra BT x BT x BV product per value block, a few percent of the kernel's FLOPs). Everything else follows the
math in dqkwg_reference.py, which also holds the PyTorch reference this kernel is tested against.

One program per (chunk, key block, value head), a chunk's key blocks next to each other in the launch order: every
key block reads the chunk's v, do and dv whole, and run together they find them in L2 (1.55x faster at K = 256,
V = 512 on an H100 than with the key blocks a batch's chunk count apart: docs/performance.md, "flame's dq/dk/dw/dg
kernel"). Per chunk c with token-local cumulative log2-decay g, start state h_c [K, V] (stored [V, K] when
state_v_first), gradient dh of the state after the chunk, output gradient do and (delta rule) dv:

    dq = scale * (2^g * (do h^T) + (ds * M) k)      ds = do v^T,  M_ts = 2^(g_t - g_s) [s <= t]
    dk = 2^(g_last - g) * (v dh^T) + scale * (ds^T * M^T) q
    dw = -dv h^T
    dg = rowsum(dq * q) - rowsum(dk * k), plus 2^g_last <h, dh> + sum(dk_state * k) at the chunk's last token.

Results per key block are exact slices of the full ones except dg, whose per-block partial sums are added after
the kernel. dg is returned before FLA's reverse cumulative sum, as FLA's kernel returns it.
"""

import torch
import triton
import triton.language as tl

from flame import compat
from flame.ops.gated_delta_rule.chunk_recurrence import sequence_bounds


def chunk_bounds(
    batch: int,
    seq_len: int,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None,
    device: torch.device,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last flat token index of every chunk, in FLA's chunk order (int64, [N] each): what the
    kernel computes for each program, for the PyTorch references.

    Computed on the device without a host sync when FLA's chunk_indices come with cu_seqlens."""
    if cu_seqlens is None:
        chunks_per_row = (seq_len + chunk_size - 1) // chunk_size
        chunk = torch.arange(batch * chunks_per_row, device=device)
        row_start = chunk.div(chunks_per_row, rounding_mode="floor") * seq_len
        chunk_start = row_start + (chunk % chunks_per_row) * chunk_size
        return chunk_start, torch.minimum(chunk_start + chunk_size, row_start + seq_len)
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
    if chunk_indices is None:
        from fla.ops.utils.index import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    sequence, chunk_in_sequence = chunk_indices.to(device=device, dtype=torch.long).unbind(-1)
    chunk_start = cu_seqlens[sequence] + chunk_in_sequence * chunk_size
    return chunk_start, torch.minimum(chunk_start + chunk_size, cu_seqlens[sequence + 1])


@triton.jit
def _dqkwg_kernel(
    q, k, v, g, h, do, dh, dv, dq, dk, dw, dg,
    cu_seqlens, chunk_indices, T, scale, num_tokens,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, USE_DW: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # (chunk, key block) on grid axis 0, whose size limit (2^31 - 1) long packed batches cannot reach; axis 1 stops
    # at 65535. Programs run in axis-0 order, so a chunk's key blocks run together.
    KEY_BLOCKS: tl.constexpr = (K + BK - 1) // BK
    i_nk, i_hv = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_k = i_nk // KEY_BLOCKS, i_nk % KEY_BLOCKS
    i_h = i_hv // (HV // H)  # the query/key head this value head reads
    # The chunk's tokens, from FLA's chunk_indices (sequence, chunk within it) with packed sequences, else from
    # the row length T; computed here, so that a call launches no index kernels of its own.
    if IS_VARLEN:
        i_seq = tl.load(chunk_indices + 2 * i_n).to(tl.int64)
        i_c = tl.load(chunk_indices + 2 * i_n + 1).to(tl.int64)
    else:
        i_seq, i_c = i_n // tl.cdiv(T, BT), i_n % tl.cdiv(T, BT)
    # sequence_bounds' third result (the sequence's first chunk) is unused: chunk_indices fills its chunk_offsets
    bos, length, _ = sequence_bounds(cu_seqlens, chunk_indices, i_seq, T, BT, IS_VARLEN)
    start = bos + i_c * BT
    end = tl.minimum(start + BT, bos + length)

    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    state = (i_n * HV + i_hv) * K * V  # offset of this chunk's [K, V] state

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_ds_t = tl.zeros([BT, BT], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dg_last = tl.zeros([1], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        # States loaded as [BV, BK] tiles whatever their layout, so no product needs a transpose of them.
        if STATE_V_FIRST:
            p_vk = state + o_v[:, None] * K + o_k[None, :]
        else:
            p_vk = state + o_v[:, None] + o_k[None, :] * V
        m_vk = m_v[:, None] & m_k[None, :]
        b_h = tl.load(h + p_vk, mask=m_vk, other=0.0)
        b_dh = tl.load(dh + p_vk, mask=m_vk, other=0.0)
        b_dg_last += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32))
        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds, input_precision=PRECISION)
        b_ds_t = tl.dot(b_v, tl.trans(b_do), b_ds_t, input_precision=PRECISION)
        b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq, input_precision=PRECISION)
        b_dk = tl.dot(b_v, b_dh.to(b_v.dtype), b_dk, input_precision=PRECISION)
        if USE_DW:
            b_dv = tl.load(dv + p_tv, mask=m_tv, other=0.0)
            b_dw = tl.dot(b_dv.to(b_v.dtype), b_h.to(b_v.dtype), b_dw, input_precision=PRECISION)

    p_tk = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
    if USE_DW:
        tl.store(dw + p_tk, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)

    p_qk = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p_qk, mask=m_tk, other=0.0)
    b_k = tl.load(k + p_qk, mask=m_tk, other=0.0)
    b_g = tl.load(g + o_t * HV + i_hv, mask=m_t, other=0.0)
    b_g_last = tl.load(g + (end - 1) * HV + i_hv)

    b_dg_last *= tl.exp2(b_g_last)
    b_dq = b_dq * tl.exp2(b_g)[:, None] * scale
    b_dk = b_dk * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
    b_dg_last += tl.sum(b_dk * b_k.to(tl.float32))

    o_r = tl.arange(0, BT)
    m_pair = m_t[:, None] & m_t[None, :]
    # ds[t, s] lives for s <= t; ds_t[s, t] = ds[t, s] is the same entry seen from the key's row.
    b_ds = tl.where((o_r[:, None] >= o_r[None, :]) & m_pair, b_ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0.0)
    b_ds_t = tl.where(
        (o_r[:, None] <= o_r[None, :]) & m_pair, b_ds_t * tl.exp2(b_g[None, :] - b_g[:, None]), 0.0
    )
    b_dq = tl.dot((b_ds * scale).to(b_k.dtype), b_k, b_dq, input_precision=PRECISION)
    b_dk = tl.dot((b_ds_t * scale).to(b_q.dtype), b_q, b_dk, input_precision=PRECISION)

    b_dg = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
    b_dg = tl.where(o_t == end - 1, b_dg + b_dg_last, b_dg)
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + (i_k * num_tokens + o_t) * HV + i_hv, b_dg, mask=m_t)


# Launch settings tried once per shape on the GPU (each compiles: keep the list short). BK is not tuned: it sets how
# many partial dg sums the kernel writes, and a tuning run must not leave stale ones for another setting. 128-wide
# key blocks (8 warps) ran no faster than 64-wide ones at K = 96, 128 and 256 on an H100 (docs/performance.md,
# "flame's dq/dk/dw/dg kernel"). Packed sequences change only how a program finds its chunk, so IS_VARLEN is not in
# the key: packed and unpacked calls of one shape share a choice.
TUNING_CONFIGS = [
    triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)
    for bv, warps, stages in [(64, 4, 2), (64, 8, 2), (64, 4, 3), (32, 4, 2)]
]
BLOCK_K = 64
_dqkwg_kernel_tuned = triton.autotune(
    TUNING_CONFIGS, key=["H", "HV", "K", "V", "BT", "BK", "STATE_V_FIRST", "USE_DW", "PRECISION"]
)(_dqkwg_kernel)


def dot_precision() -> str:
    """How the kernel's products take float32 inputs: as Triton's default does (``TRITON_F32_DEFAULT``, else TF32),
    which FLA's kernels, which this one stands in for, follow. IEEE float32 products run without tensor cores: 39 ms
    a call instead of 0.8 ms at Mamba-2's scan (8 x 2048 tokens, 24 heads, K 128, V 64) on an H200. 16-bit inputs
    are multiplied exactly either way. tests/gpu's ``exact_float32`` sets IEEE."""
    return triton.knobs.language.fp32_default or "tf32"


def chunk_bwd_dqkwg_triton(
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
    launch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Same arguments and results as ``fla.ops.common.chunk_o.chunk_bwd_dqkwg`` for the gated case.

    chunk_indices (FLA's, passed inside its backward) spare a host sync under varlen. ``launch`` fixes the launch settings
    (BK, BV, num_warps, num_stages; needed under Triton's CPU interpreter); by default BK = 64 (the next power of
    two for smaller K) and the others are autotuned."""
    if g is None or g_gamma is not None:
        raise ValueError("chunk_bwd_dqkwg_triton serves the gated case only (g given, no g_gamma)")
    if w is not None and dv is None:
        raise ValueError("dw needs dv")
    batch, seq_len, num_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[2], v.shape[3]
    group = num_v_heads // num_heads
    varlen = cu_seqlens is not None
    if varlen:
        cu_seqlens = cu_seqlens.to(q.device).contiguous()
        if chunk_indices is None:
            from fla.ops.utils.index import prepare_chunk_indices

            chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
        chunk_indices = chunk_indices.to(q.device).contiguous()
        num_chunks = chunk_indices.shape[0]
    else:
        num_chunks = batch * triton.cdiv(seq_len, chunk_size)
        cu_seqlens = chunk_indices = q  # not read
    if h.numel() != num_chunks * num_v_heads * key_dim * value_dim:
        raise ValueError(
            f"h holds {h.numel()} values, expected {num_chunks} chunks x {num_v_heads} heads x K x V"
        )
    if scale is None:
        scale = key_dim**-0.5
    num_tokens = batch * seq_len

    # With grouped value heads a q/k head gathers several value heads' gradients: keep those in float32 until summed.
    grad_dtype = q.dtype if group == 1 else torch.promote_types(q.dtype, torch.float32)
    dq = torch.empty(batch, seq_len, num_v_heads, key_dim, dtype=grad_dtype, device=q.device)
    dk = torch.empty(batch, seq_len, num_v_heads, key_dim, dtype=grad_dtype, device=q.device)
    dw = torch.empty_like(w) if w is not None else None
    block_k = launch["BK"] if launch is not None else min(BLOCK_K, max(16, triton.next_power_of_2(key_dim)))
    key_blocks = triton.cdiv(key_dim, block_k)
    dg = torch.empty(
        key_blocks, batch, seq_len, num_v_heads, dtype=torch.float32, device=q.device
    )  # per key block
    inputs = [x.contiguous() for x in (q, k, v, g, h, do, dh)]
    args = (*inputs, dv.contiguous() if w is not None else do, dq, dk, dw if w is not None else dq, dg,
            cu_seqlens, chunk_indices, seq_len, scale, num_tokens)  # fmt: skip
    meta = dict(
        H=num_heads, HV=num_v_heads, K=key_dim, V=value_dim, BT=chunk_size, STATE_V_FIRST=state_v_first,
        USE_DW=w is not None, IS_VARLEN=varlen, PRECISION=dot_precision(),
    )  # fmt: skip
    grid = (num_chunks * key_blocks, num_v_heads)
    if launch is None:
        _dqkwg_kernel_tuned[grid](*args, **meta, BK=block_k)
    else:
        _dqkwg_kernel[grid](*args, **meta, **launch)
    if group > 1:
        dq = dq.view(batch, seq_len, num_heads, group, key_dim).sum(3).to(q.dtype)
        dk = dk.view(batch, seq_len, num_heads, group, key_dim).sum(3).to(k.dtype)
    return dq, dk, dw, dg.sum(0).to(torch.promote_types(g.dtype, torch.float32))


def serve_where_fla_refuses() -> None:
    """Serve FLA's gated chunk_bwd_dqkwg with this kernel where FLA refuses its own (flame.compat's
    fla_hopper_dqkwg shim); a no-op elsewhere."""
    compat.serve_gated_dqkwg_on_hopper(chunk_bwd_dqkwg_triton)
