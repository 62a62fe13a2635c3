"""flame's Triton kernel of the (gated) delta rule's chunked forward after its WY representation, in one pass: the
state recurrence (FLA 0.6.0's ``chunk_gated_delta_rule_fwd_h``) and the output (``chunk_fwd_o``) of each chunk
together, so that neither the chunk states h nor the new values v_new go through memory. fwd_h_reference.py and
fwd_o_reference.py hold the math and the PyTorch reference it is tested against.

FLA's two kernels write h (a [K, V] state per 64-token chunk and value head: at K 256, V 512, 2,048 values per
token, 2.7 times the token's keys and values) and v_new for the output kernel to read back. When the backward
recomputes the chunk states (``fla_library.set_chunk_states("recompute")``, the default), the forward needs neither
afterwards, and this kernel reads q, k, w and u once and writes o. One program per (value block, sequence x value
head), a head's value blocks next to each other in the launch so that they read the head's q, k and w from L2; each
carries its [K, BV] slice of the state through the sequence's chunks as one float32 tile (the layout of
fwd_h_triton.py), and per chunk computes, from the state at the chunk's start:

    v_new = u - w h;   o = scale * (2^g * (q h) + tril(q k^T * 2^(g_i - g_j)) v_new);
    h = 2^g_last * h + k^T (2^(g_last - g) * v_new)

with h and v_new rounded to the inputs' dtype where they enter a product, as FLA's kernels store them.
"""

import functools

import torch
import triton
import triton.language as tl

from flame.ops.gated_delta_rule.chunk_recurrence import (
    autotuned,
    check_call,
    fitting,
    key_block,
    launch_recurrence,
    state_tile,
    takes,
)
from flame.ops.gated_delta_rule.dqkwg_triton import dot_precision


@triton.jit
def _fwd_o_kernel(
    q, k, w, u, g, h0, o, ht, cu_seqlens, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)  # the key head this value head reads
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_tile(i_v, K, V, BK, BV, STATE_V_FIRST)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + p_kv, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(tl.cdiv(T, BT)):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = ((bos + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        b_q = tl.load(q + ((bos + o_t[:, None]) * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        # k's transposed [BK, BT] tile: for q k^T and for the state update
        b_kt = tl.load(k + ((bos + o_t[None, :]) * H + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                       other=0.0)  # fmt: skip
        b_w = tl.load(w + ((bos + o_t[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_state = b_h.to(b_w.dtype)
        b_v = tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_v -= tl.dot(b_w, b_state, input_precision=PRECISION)
        b_v_new = b_v.to(u.dtype.element_ty)
        b_o = tl.dot(b_q, b_state, input_precision=PRECISION)
        b_A = tl.dot(b_q, b_kt, input_precision=PRECISION)
        if USE_G:
            last = tl.minimum((i_t + 1) * BT, T) - 1
            b_g_last = tl.load(g + (bos + last) * HV + i_hv).to(tl.float32)
            b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
            b_o *= tl.exp2(b_g)[:, None]
            b_A *= tl.exp2(b_g[:, None] - b_g[None, :])
        # causal within the chunk; where() after the decay, whose upper triangle may overflow
        b_A = tl.where((o_t[:, None] >= o_t[None, :]) & m_t[None, :], b_A, 0.0)
        b_o += tl.dot(b_A.to(b_v_new.dtype), b_v_new, input_precision=PRECISION)
        tl.store(o + p_tv, (b_o * scale).to(o.dtype.element_ty), mask=m_tv)

        if USE_G:
            b_v *= tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
            b_h *= tl.exp2(b_g_last)
        b_h += tl.dot(b_kt, b_v.to(b_kt.dtype), input_precision=PRECISION)

    if STORE_FINAL_STATE:
        tl.store(ht + i_nh * K * V + p_kv, b_h, mask=m_kv)


# The one launch setting: on an H100 (2026-12-06, bench/recurrences.py --recurrences fwd_o, 8 x 2048 tokens, bf16,
# value-first states) BV 32 with 4 warps and 2 stages beat BV 64 with 8 warps and 1 or 2 stages at K 96 and K 128
# (0.314 and 0.216 ms against 0.428 and 0.285 at best). At K 256 it does not fit, and the settings that do (one
# stage) took 0.79-1.02 ms, slower than FLA's two kernels (0.654 ms), so calls with K 256 stay with those.
TUNING_CONFIGS = [triton.Config({"BV": 32}, num_warps=4, num_stages=2)]


def shared_memory_bytes(
    config: triton.Config, key_block: int, chunk_size: int, element_size: int, state_v_first: bool
) -> int:
    """An upper bound on the shared memory a setting needs: each pipeline stage holds a chunk's q, k and w
    ([BT, BK]) and its u ([BT, BV]); the state passes through it as the [BK, BV] operand of w h and q h, the
    intra-chunk scores [BT, BT] and v_new [BT, BV] as operands of the output's second product, and key-first states
    pass it once more on their way in and out. One stage (no pipelining) still stages each tile once."""
    block_v = config.kwargs["BV"]
    tile = key_block * block_v * element_size
    chunk_tiles = max(1, config.num_stages) * chunk_size * (3 * key_block + block_v) * element_size
    operands = tile + chunk_size * (chunk_size + block_v) * element_size
    return chunk_tiles + operands + (0 if state_v_first else tile)


# (key_block, chunk_size, element_size, state_v_first, limit) -> the settings whose bound is within limit
fitting_configs = functools.partial(fitting, TUNING_CONFIGS, shared_memory_bytes)


_fwd_o_kernel_tuned = autotuned(_fwd_o_kernel, TUNING_CONFIGS, fitting_configs, "k")


def serves(k: torch.Tensor, chunk_size: int, state_v_first: bool) -> bool:
    """Whether a training forward that keeps no chunk states runs this kernel instead of the state recurrence and
    FLA's output kernel (chunk_recurrence.takes: bf16, value-first states, a setting that fits, which is keys up to
    128 wide): bench/recurrences.py measured it 1.20x their speed at 16x96x192 and 1.35x at 16x128x128 on an H100."""
    return takes(k, chunk_size, state_v_first, fitting_configs)


def chunk_fwd_o_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
    launch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, final state): what FLA's ``chunk_gated_delta_rule_fwd_h`` followed by its ``chunk_fwd_o`` return of them,
    for the same arguments (scale K^-0.5 by default). ``launch`` fixes BV, num_warps and num_stages (needed under
    Triton's CPU interpreter); by default they are autotuned. chunk_indices are accepted for FLA's signature: the
    kernel walks each sequence's chunks itself."""
    del chunk_indices
    batch, seq_len, num_heads, key_dim = k.shape
    num_v_heads, value_dim = u.shape[2], u.shape[3]
    check_call("state recurrence with the output", "chunk_gated_delta_rule_fwd_h and chunk_fwd_o", k, chunk_size,
               state_v_first, fitting_configs, launch)  # fmt: skip
    if scale is None:
        scale = key_dim**-0.5
    sequences = batch
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=k.device, dtype=torch.long)
        sequences = cu_seqlens.numel() - 1
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    o = torch.empty_like(u)
    final_state = (
        k.new_empty(sequences, num_v_heads, *state_shape, dtype=torch.float32) if output_final_state else None
    )
    args = (q.contiguous(), k.contiguous(), w.contiguous(), u.contiguous(), g.contiguous() if g is not None else k,
            initial_state.contiguous() if initial_state is not None else k, o,
            final_state if final_state is not None else o, cu_seqlens if cu_seqlens is not None else k,
            scale, seq_len)  # fmt: skip
    meta = dict(
        H=num_heads, HV=num_v_heads, K=key_dim, V=value_dim, BT=chunk_size, BK=key_block(key_dim),
        USE_G=g is not None, USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final_state is not None,
        STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None, PRECISION=dot_precision(),
    )  # fmt: skip
    launch_recurrence(
        _fwd_o_kernel, _fwd_o_kernel_tuned, launch, value_dim, sequences * num_v_heads, args, meta
    )
    return o, final_state
