"""flame's Triton kernel for the dh recurrence of the (gated) delta rule's chunked backward, with the arguments and
results of FLA 0.6.0's ``chunk_gated_delta_rule_bwd_dhu`` (dhu_reference.py holds the math and the PyTorch reference
it is tested against).

One program per (value block, sequence x value head), a head's value blocks next to each other in the launch so
that they read the head's k, q and w from L2. The program carries its [K, BV] slice of the state gradient through
the sequence's chunks from the last to the first as one float32 tile (K padded to a power of two), where FLA's
kernel holds it as up to four 64-wide tiles: per chunk one product k dh for dv2, and q^T do - w^T dv2 for the
update, each over the whole K at once. Called without dv, it also forms the intra-chunk part of dv2 (FLA's
``chunk_bwd_dv_local``: the chunk's scale k q^T, decayed and masked to queries at or after each key, times do)
from the k, q and do tiles it loads anyway, so that part is neither a kernel of its own nor written and read back.
"""

import functools

import torch
import triton
import triton.language as tl

from flame.ops.gated_delta_rule.chunk_recurrence import (
    autotuned,
    check_call,
    chunk_layout,
    fitting,
    key_block,
    launch_recurrence,
    sequence_bounds,
    state_tile,
    takes,
)
from flame.ops.gated_delta_rule.dqkwg_triton import dot_precision


@triton.jit
def _dhu_kernel(
    q, k, w, g, dht, dh0, do, dh, dv, dv2, cu_seqlens, chunk_offsets, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, LOCAL_DV: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)  # the query/key head this value head reads
    bos, T, boh = sequence_bounds(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)
    num_chunks = tl.cdiv(T, BT)
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_tile(i_v, K, V, BK, BV, STATE_V_FIRST)

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + i_nh * K * V + p_kv, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(num_chunks - 1, -1, -1):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        tl.store(dh + ((boh + i_t) * HV + i_hv) * K * V + p_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)

        p_tk = (bos + o_t[:, None]) * (H * K) + i_h * K + o_k[None, :]
        p_tv = ((bos + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
        b_dv = tl.dot(b_k, b_dh.to(b_k.dtype), input_precision=PRECISION)
        # Transposed [BK, BT] tiles of q and w for the state update.
        p_kt = (bos + o_t[None, :]) * (H * K) + i_h * K + o_k[:, None]
        p_wt = ((bos + o_t[None, :]) * HV + i_hv) * K + o_k[:, None]
        m_kt = m_k[:, None] & m_t[None, :]
        b_qt = tl.load(q + p_kt, mask=m_kt, other=0.0)
        b_wt = tl.load(w + p_wt, mask=m_kt, other=0.0)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        if LOCAL_DV:  # scale k_i . q_j for key i and query j >= i, before q takes its decay
            b_A = tl.dot(b_k, b_qt, input_precision=PRECISION) * scale
            m_A = (o_t[:, None] <= o_t[None, :]) & m_t[:, None] & m_t[None, :]
        if USE_G:
            last = tl.minimum((i_t + 1) * BT, T) - 1
            b_g_last = tl.load(g + (bos + last) * HV + i_hv).to(tl.float32)
            b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
            b_dv *= tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
            b_dh *= tl.exp2(b_g_last)
            b_qt = (b_qt.to(tl.float32) * tl.exp2(b_g)[None, :]).to(b_k.dtype)
            if LOCAL_DV:  # 2^(g_j - g_i) <= 1 where j >= i; the other entries are masked before the exponent
                b_A *= tl.exp2(tl.where(m_A, b_g[None, :] - b_g[:, None], 0.0))
        if LOCAL_DV:
            b_A = tl.where(m_A, b_A, 0.0).to(b_do.dtype)
            b_dv += tl.dot(b_A, b_do, input_precision=PRECISION)
        else:
            b_dv += tl.load(dv + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(dv2 + p_tv, b_dv.to(dv2.dtype.element_ty), mask=m_tv)
        if BK > 128 and not LOCAL_DV:
            # The products accumulate into b_dh itself: at K 256 their own float32 tiles spill registers (H100:
            # 0.550 against 0.630 ms at 6x256x512). Narrower keys and the dv-forming form are faster as below.
            b_dh = tl.dot(
                b_qt, (b_do.to(tl.float32) * scale).to(b_qt.dtype), acc=b_dh, input_precision=PRECISION
            )
            b_dh = tl.dot(b_wt, (-b_dv).to(b_wt.dtype), acc=b_dh, input_precision=PRECISION)
        else:
            b_dh += scale * tl.dot(b_qt, b_do.to(b_qt.dtype), input_precision=PRECISION)
            b_dh -= tl.dot(b_wt, b_dv.to(b_wt.dtype), input_precision=PRECISION)

    if USE_INITIAL_STATE:
        tl.store(dh0 + i_nh * K * V + p_kv, b_dh, mask=m_kv)


# Launch settings tried once per shape on the GPU (each compiles: keep the list short). On an H100 (2026-12-06,
# 8 x 2048 tokens, bf16) BV 64 with 8 warps won at 6x256x512 (2 stages), 16x96x192 and 16x128x128 (3 stages);
# BV 32 with 4 warps is the setting whose tiles fit with float32 inputs at K 128.
TUNING_CONFIGS = [
    triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)
    for bv, warps, stages in [(64, 8, 2), (64, 8, 3), (32, 4, 2)]
]


def shared_memory_bytes(
    config: triton.Config, key_block: int, chunk_size: int, element_size: int, state_v_first: bool
) -> int:
    """An upper bound on the shared memory a setting needs: each pipeline stage holds a chunk's k, q and w
    ([BT, BK]) and its do and dv ([BT, BV]); key-first states also pass the [BK, BV] tile through shared memory
    on their way out. Formed in the kernel, the intra-chunk dv replaces the stages' dv tiles with one [BT, BT]
    tile, no larger for these settings (BV x stages >= BT). Triton's compiler asks for no more than this (sm_90,
    bf16, K 256, BV 64, 2 stages: 229,376 bytes estimated, 217,604 compiled value-first with Triton 3.6 and 3.7.1;
    262,144 estimated key-first, 229,892 compiled with Triton 3.7.1)."""
    chunk_tiles = config.num_stages * chunk_size * (3 * key_block + 2 * config.kwargs["BV"]) * element_size
    return chunk_tiles + (0 if state_v_first else key_block * config.kwargs["BV"] * element_size)


# (key_block, chunk_size, element_size, state_v_first, limit) -> the settings whose bound is within limit
fitting_configs = functools.partial(fitting, TUNING_CONFIGS, shared_memory_bytes)


_dhu_kernel_tuned = autotuned(_dhu_kernel, TUNING_CONFIGS, fitting_configs, "q", more_key=("LOCAL_DV",))


def serves(q: torch.Tensor, chunk_size: int, state_v_first: bool) -> bool:
    """Whether training runs flame's kernel for this call (chunk_recurrence.takes). Key-first states stay on FLA's
    kernel: at K 256 only BV 32 fits them, the setting that is slower than FLA's kernel value-first."""
    return takes(q, chunk_size, state_v_first, fitting_configs)


def forms_local_dv(q: torch.Tensor, do: torch.Tensor) -> bool:
    """Whether training, where the kernel serves, lets it form the intra-chunk dv rather than run FLA's
    chunk_bwd_dv_local first. Every value block recomputes the chunk's [BT, BT] scores k q^T, so the extra work grows
    with K x V. On an H100 (2026-12-07, 8 x 2048 tokens, bf16) forming it won at 16x128x128 (0.256 ms against 0.279
    for chunk_bwd_dv_local then this kernel) and lost at 16x96x192 (0.376 against 0.352) and 6x256x512 (0.992
    against 0.747)."""
    return q.shape[-1] * do.shape[-1] <= 128 * 128


def chunk_bwd_dhu_triton(
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
    chunk_indices: torch.Tensor | None = None,
    launch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Same arguments and results as FLA's ``chunk_gated_delta_rule_bwd_dhu`` without per-key gates: (dh, dh0,
    dv2). dv None: the kernel forms the intra-chunk part itself, as FLA's ``chunk_bwd_dv_local`` with the same q,
    k, g, do, scale and chunks would. ``launch`` fixes BV, num_warps and num_stages (needed under Triton's CPU
    interpreter); by default they are autotuned. chunk_indices (FLA's [chunks, 2], passed inside its backward) give
    the chunk count under varlen without a host sync."""
    batch, seq_len, num_heads, key_dim = q.shape
    num_v_heads, value_dim = do.shape[2], do.shape[3]
    check_call(
        "dh recurrence",
        "chunk_gated_delta_rule_bwd_dhu",
        q,
        chunk_size,
        state_v_first,
        fitting_configs,
        launch,
    )
    scale = key_dim**-0.5 if scale is None else scale
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    sequences, chunk_offsets, chunks, rows = chunk_layout(
        batch, seq_len, chunk_size, cu_seqlens, chunk_indices
    )
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    dh = q.new_empty(rows, chunks, num_v_heads, *state_shape)
    dh0 = torch.empty(h0.shape, dtype=torch.float32, device=q.device) if h0 is not None else None
    dv2 = torch.empty_like(do)
    inputs = [x.contiguous() for x in (q, k, w)]
    args = (*inputs, g.contiguous() if g is not None else q, dht.contiguous() if dht is not None else q,
            dh0 if dh0 is not None else dv2, do.contiguous(), dh, dv.contiguous() if dv is not None else do, dv2,
            cu_seqlens if cu_seqlens is not None else q, chunk_offsets if chunk_offsets is not None else q,
            scale, seq_len)  # fmt: skip
    meta = dict(
        H=num_heads, HV=num_v_heads, K=key_dim, V=value_dim, BT=chunk_size,
        BK=key_block(key_dim), USE_G=g is not None, USE_INITIAL_STATE=h0 is not None,
        USE_FINAL_STATE_GRADIENT=dht is not None, STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None,
        PRECISION=dot_precision(), LOCAL_DV=dv is None,
    )  # fmt: skip
    launch_recurrence(_dhu_kernel, _dhu_kernel_tuned, launch, value_dim, sequences * num_v_heads, args, meta)
    return dh, dh0, dv2
