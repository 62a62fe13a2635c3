"""flame's Triton kernel for the state recurrence of the (gated) delta rule's chunked forward, with the arguments and
results of FLA 0.6.0's ``chunk_gated_delta_rule_fwd_h`` (fwd_h_reference.py holds the math and the PyTorch reference
it is tested against). The custom ops run it in the forward and in the backward's recompute.

One program per (value block, sequence x value head), a head's value blocks next to each other in the launch so
that they read the head's k and w from L2. The program carries its [K, BV] slice of the state through the sequence's
chunks as one float32 tile (K padded to a power of two), where FLA's kernel holds it as up to four 64-wide tiles:
per chunk one product w h for the new values and one k^T v_new for the update, each over the whole K at once (the
layout of flame's dh recurrence, dhu_triton.py).
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
def _fwd_h_kernel(
    k, w, u, g, h0, h, v_new, ht, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)  # the key head this value head reads
    bos, T, boh = sequence_bounds(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)
    num_chunks = tl.cdiv(T, BT)
    o_k, m_k, o_v, m_v, m_kv, p_kv = state_tile(i_v, K, V, BK, BV, STATE_V_FIRST)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + p_kv, mask=m_kv, other=0.0).to(tl.float32)

    for i_t in range(num_chunks):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        tl.store(h + ((boh + i_t) * HV + i_hv) * K * V + p_kv, b_h.to(h.dtype.element_ty), mask=m_kv)

        p_tv = ((bos + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(w + ((bos + o_t[:, None]) * HV + i_hv) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                      other=0.0)  # fmt: skip
        b_v = tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_v -= tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PRECISION)
        tl.store(v_new + p_tv, b_v.to(v_new.dtype.element_ty), mask=m_tv)
        # k's transposed [BK, BT] tile for the state update.
        b_kt = tl.load(k + (bos + o_t[None, :]) * (H * K) + i_h * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                       other=0.0)  # fmt: skip
        if USE_G:
            last = tl.minimum((i_t + 1) * BT, T) - 1
            b_g_last = tl.load(g + (bos + last) * HV + i_hv).to(tl.float32)
            b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
            b_v *= tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
            b_h *= tl.exp2(b_g_last)
        b_h += tl.dot(b_kt, b_v.to(b_kt.dtype), input_precision=PRECISION)

    if STORE_FINAL_STATE:
        tl.store(ht + i_nh * K * V + p_kv, b_h, mask=m_kv)


# Launch settings tried once per shape on the GPU (each compiles: keep the list short). On an H100 (2026-12-06,
# 8 x 2048 tokens, bf16, value-first states) BV 64 with 8 warps won over BV 64 with 4 warps and BV 32 with 4 at
# every shape: 2 stages at K 256 (3 do not fit), 3 at K 96 and K 128.
TUNING_CONFIGS = [triton.Config({"BV": 64}, num_warps=8, num_stages=stages) for stages in (2, 3)]


def shared_memory_bytes(
    config: triton.Config, key_block: int, chunk_size: int, element_size: int, state_v_first: bool
) -> int:
    """An upper bound on the shared memory a setting needs: each pipeline stage holds a chunk's k and w ([BT, BK])
    and its u ([BT, BV]), the state passes through it as the [BK, BV] operand of w h, and key-first states pass it
    once more on their way out. Triton's compiler asked 250,376 bytes for BV 64, 8 warps, 3 stages at K 256 in bf16
    with value-first states (H100, Triton 3.6), where this bound gives 253,952."""
    tile = key_block * config.kwargs["BV"] * element_size
    chunk_tiles = config.num_stages * chunk_size * (2 * key_block + config.kwargs["BV"]) * element_size
    return chunk_tiles + tile + (0 if state_v_first else tile)


# (key_block, chunk_size, element_size, state_v_first, limit) -> the settings whose bound is within limit
fitting_configs = functools.partial(fitting, TUNING_CONFIGS, shared_memory_bytes)


_fwd_h_kernel_tuned = autotuned(_fwd_h_kernel, TUNING_CONFIGS, fitting_configs, "k")


def serves(k: torch.Tensor, chunk_size: int, state_v_first: bool) -> bool:
    """Whether training runs flame's kernel for this call (chunk_recurrence.takes) with keys wider than 128, the
    only width where bench/recurrences.py measured it faster than FLA's kernel (6x256x512 on an H100: 0.338 ms
    against 0.389; at 16x128x128 even, at 16x96x192 0.90x FLA's speed)."""
    return k.shape[-1] > 128 and takes(k, chunk_size, state_v_first, fitting_configs)


def chunk_fwd_h_triton(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
    launch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same arguments and results as FLA's ``chunk_gated_delta_rule_fwd_h`` without per-key gates: (h, v_new,
    final state). ``launch`` fixes BV, num_warps and num_stages (needed under Triton's CPU interpreter); by default
    they are autotuned. chunk_indices (FLA's [chunks, 2]) give the chunk count under varlen without a host sync."""
    batch, seq_len, num_heads, key_dim = k.shape
    num_v_heads, value_dim = u.shape[2], u.shape[3]
    check_call(
        "state recurrence",
        "chunk_gated_delta_rule_fwd_h",
        k,
        chunk_size,
        state_v_first,
        fitting_configs,
        launch,
    )
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=k.device, dtype=torch.long)
    sequences, chunk_offsets, chunks, rows = chunk_layout(
        batch, seq_len, chunk_size, cu_seqlens, chunk_indices
    )
    state_shape = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    h = k.new_empty(rows, chunks, num_v_heads, *state_shape)
    v_new = torch.empty_like(u)
    final_state = (
        k.new_empty(sequences, num_v_heads, *state_shape, dtype=torch.float32) if output_final_state else None
    )
    args = (k.contiguous(), w.contiguous(), u.contiguous(), g.contiguous() if g is not None else k,
            initial_state.contiguous() if initial_state is not None else k, h, v_new,
            final_state if final_state is not None else v_new,
            cu_seqlens if cu_seqlens is not None else k, chunk_offsets if chunk_offsets is not None else k,
            seq_len)  # fmt: skip
    meta = dict(
        H=num_heads, HV=num_v_heads, K=key_dim, V=value_dim, BT=chunk_size, BK=key_block(key_dim),
        USE_G=g is not None, USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final_state is not None,
        STATE_V_FIRST=state_v_first, IS_VARLEN=cu_seqlens is not None, PRECISION=dot_precision(),
    )  # fmt: skip
    launch_recurrence(
        _fwd_h_kernel, _fwd_h_kernel_tuned, launch, value_dim, sequences * num_v_heads, args, meta
    )
    return h, v_new, final_state
