"""Fused causal softpick / rectified-softmax attention in Triton (flash-style: memory linear in T).

    softpick_attention(q, k, v, variant="softpick", window_size=None, cu_seqlens=None, scale=None) -> o

Same contract and semantics as `reference_attention(..., causal=True)` in reference.py, which the tests compare
against: q [B, Tq, H, D], k/v [B, Tk, HKV, D] with Tk >= Tq, query head h reads key/value head h // (H // HKV).
Queries are aligned to the end of the keys: query row i sits at position i + OFFSET, OFFSET = Tk - Tq (0 for
self-attention; a context-parallel rank passes its Tq queries and the Tk keys up to its slice's end), and sees keys
j <= i + OFFSET; window_size w lets it see keys i + OFFSET - w < j <= i + OFFSET; cu_seqlens (batch 1, Tq == Tk =
T, int32/int64 [N + 1]) makes the attention block-diagonal per document. It is not checked against T here (that
would need a host sync): cu_seqlens[-1] must equal T. float16 / bfloat16 / float32 inputs, float32 accumulation,
output in q's dtype. Head dims 64 and 128 run as they are; smaller ones are zero-padded inside the kernel up to 64
or 128 (masked loads: zero columns change no score and only add output columns that are never stored); head dims
above 128 are refused.

Per query row i with scores s_j = scale * q_i . k_j over the visible keys (all quantities in float32):
- softpick: m = max(0, max_j s_j), a = sum_j |e^(s_j - m) - e^-m| + SOFTPICK_EPS (eps in the shifted space, as
  reference.py documents), o = sum_j relu(e^(s_j - m) - e^-m) v_j / a, lse = m + log(a). A row whose scores are
  all <= 0 gets exactly 0. A masked key gets the score 0, whose term e^-m - e^-m is exactly 0 in both sums.
- rectified: softmax over the visible s_j >= 0, lse = logsumexp of those; a row without one gets o = 0 and
  lse = +inf (so that the backward's e^(s - lse) is 0 there).
lse ([B, H, Tq], float32, natural log) is saved for the backward, which recomputes e_ij = e^(s_ij - lse_i):
- softpick: P = relu(e - e^-lse), dS = e * (1[s > 0] dP - sign(s) delta) (from d relu(e^s - 1)/ds = e^s 1[s > 0]
  and d|e^s - 1|/ds = e^s sign(s); the derivative of the denominator's eps e^m is dropped, an O(eps) change);
- rectified: P = 1[s >= 0] e, dS = P * (dP - delta);
with dP = dO V^T and delta_i = dO_i . O_i, as in FlashAttention-2.

Structure after FlashAttention-2 and Triton's fused-attention tutorial: the forward runs one program per (query
block, head) with an online max / denominator; the backward is a delta preprocess, one kernel for dK/dV per
(key block, kv head) that loops over query blocks and the query heads of its GQA group (no atomics), and one for
dQ per (query block, head) that loops over key blocks. Scores are kept in log2 units (log2(e) folded into the
scale, exp2). Each loop visits only the key (query) blocks that a causal / window / document mask leaves
non-empty, and runs in three ranges: blocks fully visible to every row of the block run without masks, the
ones at the edges (diagonal, window edge, document boundaries, the ragged end) with them. Block indices count
rows of q (of k): only the masks and the ranges compare positions, which add OFFSET to a query row.

Under torch.compile the kernels run as the torch custom ops `torch.ops.flame.softpick_attention_fwd` / `_bwd` (one
node each, autograd registered on the forward); eager calls run the same code as an autograd.Function
(flame.ops.custom_ops), which costs the host less than the op's dispatch. With TRITON_INTERPRET=1 set before this
module is imported, the kernels run in Triton's CPU interpreter with one small block configuration (the CPU tests
do that).
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from flame.ops.attention.reference import SOFTPICK_EPS, check_query_key_lengths
from flame.ops.custom_ops import differentiable_op

VARIANTS = ("softpick", "rectified")
MAX_HEAD_DIM = 128
LOG2E = 1.4426950408889634
# Kernels read globals only as constexprs.
LOG2E_JIT = tl.constexpr(LOG2E)
LN2_JIT = tl.constexpr(0.6931471805599453)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _configs(blocks: dict[int, list[tuple[int, int, int, int]]], rows: str, cols: str) -> list[triton.Config]:
    """{tag: [(rows, cols, num_warps, num_stages)]} -> configs; the tag is the padded head dim a config serves,
    0 for the float32 (exact products) one that serves all."""
    return [
        triton.Config({rows: r, cols: c, "CONFIG_TAG": tag}, num_warps=warps, num_stages=stages)
        for tag, choices in blocks.items()
        for r, c, warps, stages in choices
    ]


def _configs_for(configs, named_args, **kwargs):
    tag = 0 if kwargs["DOT_PRECISION"] == "ieee" else kwargs["BLOCK_D"]
    return [c for c in configs if c.kwargs["CONFIG_TAG"] == tag]


# Few configs per kernel and head dim (every one is compiled and timed once per tuning key). Rows of the forward /
# dQ tiles and key rows of dK/dV are the MMA's M dimension: 64 or 128 keep Hopper's wgmma fed. float32 inputs
# (tests) multiply exactly on CUDA cores, which needs small tiles to stay in registers.
if INTERPRETED:
    # Unequal, small blocks so that the CPU tests cross block edges in both directions quickly.
    FWD_CONFIGS = _configs({0: [(32, 16, 1, 1)]}, "BLOCK_M", "BLOCK_N")
    DKDV_CONFIGS = _configs({0: [(32, 16, 1, 1)]}, "BLOCK_N", "BLOCK_M")
    DQ_CONFIGS = _configs({0: [(16, 32, 1, 1)]}, "BLOCK_M", "BLOCK_N")
else:
    FWD_CONFIGS = _configs(
        {
            64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)],
            128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
            0: [(32, 32, 4, 1)],
        },
        "BLOCK_M",
        "BLOCK_N",
    )
    # dK/dV holds k, v and both float32 accumulators for its whole life: 8 warps and 32-row query blocks keep
    # ptxas' spills small (tens of bytes at head dim 64 on sm_90).
    DKDV_CONFIGS = _configs(
        {
            64: [(128, 32, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3)],
            128: [(128, 32, 8, 2), (128, 32, 8, 3), (64, 32, 8, 3)],
            0: [(32, 32, 4, 1)],
        },
        "BLOCK_N",
        "BLOCK_M",
    )
    DQ_CONFIGS = _configs(
        {
            64: [(128, 32, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3)],
            128: [(128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
            0: [(32, 32, 4, 1)],
        },
        "BLOCK_M",
        "BLOCK_N",
    )
PRUNE = {"early_config_prune": _configs_for}
TUNING_KEY = ["TQ", "TK", "BLOCK_D", "SOFTPICK", "IS_VARLEN", "HAS_WINDOW", "DOT_PRECISION"]


@triton.jit
def _load_rows(base, rows, stride_t, offs_d, T, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """x[rows, :BLOCK_D] of a [T, HEAD_DIM] slice (last stride 1); rows past T and padded columns read 0."""
    ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
    if CHECK_ROWS:
        x = tl.load(ptrs, mask=(rows < T)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif offs_d.shape[0] == HEAD_DIM:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return x


@triton.jit
def _store_rows(base, x, rows, stride_t, offs_d, T, HEAD_DIM: tl.constexpr):
    ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(rows < T)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _visible(q_pos, k_pos, q_doc, k_doc, window, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr):
    """[len(q_pos), len(k_pos)] bool: causal, inside the window, same document (reference.visibility_mask); q_pos
    are positions (rows + OFFSET), q_doc the documents of the rows."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if HAS_WINDOW:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    if IS_VARLEN:
        visible &= k_doc[None, :] == q_doc[:, None]
    return visible


@triton.jit
def _key_ranges(
    start_m, TQ, OFFSET, DOC, CU, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW, IS_VARLEN
):
    """Key blocks of query rows [start_m, start_m + BLOCK_M): [lo, full_lo) and [full_hi, hi) need the mask,
    [full_lo, full_hi) is visible to every row. lo, full_lo (unless clamped to hi) and full_hi are multiples of
    BLOCK_N; hi <= Tk, and keys below full_hi lie below Tk."""
    last_m = tl.minimum(start_m + BLOCK_M, TQ) - 1
    first_pos = start_m + OFFSET
    last_pos = last_m + OFFSET
    lo = 0
    full_lo = 0
    if IS_VARLEN:  # OFFSET is 0: rows are positions
        lo = tl.load(CU + tl.load(DOC + start_m))  # first key of the first row's document
        full_lo = tl.load(CU + tl.load(DOC + last_m))  # keys from here on share the last row's document
    if HAS_WINDOW:
        lo = tl.maximum(lo, first_pos - window + 1)
        full_lo = tl.maximum(full_lo, last_pos - window + 1)
    hi = last_pos + 1
    lo = lo // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, hi)
    # Causal: a block is fully visible when its last key is <= the first row's position.
    full_hi = tl.maximum((first_pos + 1) // BLOCK_N * BLOCK_N, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(
    start_n, TQ, OFFSET, DOC, CU, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW, IS_VARLEN
):
    """Query row blocks that see keys [start_n, start_n + BLOCK_N), split as in `_key_ranges` (multiples of
    BLOCK_M); 0 <= lo <= full_lo <= full_hi <= hi <= Tq, and rows below full_hi lie below Tq."""
    last_n = tl.minimum(start_n + BLOCK_N, TQ + OFFSET) - 1
    hi = TQ
    full_hi = TQ
    if IS_VARLEN:  # OFFSET is 0: rows are positions
        hi = tl.load(CU + tl.load(DOC + last_n) + 1)  # end of the last key's document
        full_hi = tl.load(CU + tl.load(DOC + start_n) + 1)  # rows before it share the first key's document
    if HAS_WINDOW:
        # Clamped at 0: with OFFSET > 0 a key block may lie before every query's window (no row sees it).
        hi = tl.maximum(tl.minimum(hi, last_n + window - OFFSET), 0)
        full_hi = tl.maximum(tl.minimum(full_hi, start_n + window - OFFSET), 0)
    # Rows before start_n - OFFSET see none of these keys. Clamped at 0, so that // and cdiv only see non-negative
    # numbers (Triton's integer division truncates toward zero).
    lo = tl.maximum(start_n - OFFSET, 0) // BLOCK_M * BLOCK_M
    # Causal: a block is fully visible when its first row's position is >= the last key.
    full_lo = tl.minimum(tl.cdiv(tl.maximum(last_n - OFFSET, 0), BLOCK_M) * BLOCK_M, hi)
    full_hi = tl.maximum(tl.minimum(full_hi // BLOCK_M * BLOCK_M, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_blocks(
    acc, m_i, a_i, q, q_pos, q_doc, k_base, v_base, stride_kt, stride_vt, DOC, lo, hi, qk_scale, window, TK,
    offs_n, offs_d,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SOFTPICK: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        k = _load_rows(k_base, k_pos, stride_kt, offs_d, TK, MASKED, HEAD_DIM)
        v = _load_rows(v_base, k_pos, stride_vt, offs_d, TK, MASKED, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            k_doc = tl.load(DOC + k_pos, mask=k_pos < TK, other=-2) if IS_VARLEN else k_pos
            visible = _visible(q_pos, k_pos, q_doc, k_doc, window, HAS_WINDOW, IS_VARLEN)
            # softpick: a score of 0 adds exactly 0 to both sums; rectified: -inf is never kept.
            qk = tl.where(visible, qk, 0.0 if SOFTPICK else float("-inf"))
        # m starts at 0 (the clamp of the row max at 0) and only grows: e^(s - m) <= 1, e^-m <= 1.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        e = tl.math.exp2(qk * qk_scale - m_new[:, None])
        if SOFTPICK:
            p = e - tl.math.exp2(-m_new)[:, None]
            a_i = a_i * alpha + tl.sum(tl.abs(p), 1)
            p = tl.maximum(p, 0.0)
        else:
            p = tl.where(qk >= 0, e, 0.0)
            a_i = a_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, a_i


@triton.autotune(configs=FWD_CONFIGS, key=TUNING_KEY, prune_configs_by=PRUNE)
@triton.jit
def _fwd_kernel(
    Q, K, V, OUT, LSE, DOC, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
    qk_scale, window, TQ, TK, H, GROUP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CONFIG_TAG: tl.constexpr, SOFTPICK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    # The last query blocks have the most keys: start them first so that the short ones fill the tail.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_base = Q + b.to(tl.int64) * stride_qb + h * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + (h // GROUP) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + (h // GROUP) * stride_vh
    offset = TK - TQ
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_base, offs_m, stride_qt, offs_d, TQ, True, HEAD_DIM)
    q_pos = offs_m + offset
    q_doc = tl.load(DOC + offs_m, mask=offs_m < TQ, other=-1) if IS_VARLEN else offs_m

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    a_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(
        start_m, TQ, offset, DOC, CU, window, BLOCK_M, BLOCK_N, HAS_WINDOW, IS_VARLEN
    )
    acc, m_i, a_i = _fwd_blocks(
        acc, m_i, a_i, q, q_pos, q_doc, k_base, v_base, stride_kt, stride_vt, DOC, lo, full_lo, qk_scale, window,
        TK, offs_n, offs_d, True, HEAD_DIM, BLOCK_N, SOFTPICK, IS_VARLEN, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, a_i = _fwd_blocks(
        acc, m_i, a_i, q, q_pos, q_doc, k_base, v_base, stride_kt, stride_vt, DOC, full_lo, full_hi, qk_scale,
        window, TK, offs_n, offs_d, False, HEAD_DIM, BLOCK_N, SOFTPICK, IS_VARLEN, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, a_i = _fwd_blocks(
        acc, m_i, a_i, q, q_pos, q_doc, k_base, v_base, stride_kt, stride_vt, DOC, full_hi, hi, qk_scale, window,
        TK, offs_n, offs_d, True, HEAD_DIM, BLOCK_N, SOFTPICK, IS_VARLEN, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip

    if SOFTPICK:
        a_i += EPS
        lse = (m_i + tl.math.log2(a_i)) * LN2_JIT
    else:
        nonempty = a_i > 0
        a_i = tl.where(nonempty, a_i, 1.0)
        lse = tl.where(nonempty, (m_i + tl.math.log2(a_i)) * LN2_JIT, float("inf"))
    o_base = OUT + b.to(tl.int64) * stride_ob + h * stride_oh
    _store_rows(o_base, acc / a_i[:, None], offs_m, stride_ot, offs_d, TQ, HEAD_DIM)
    tl.store(LSE + bh.to(tl.int64) * TQ + offs_m, lse, mask=offs_m < TQ)


@triton.jit
def _bwd_preprocess(
    OUT, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh, TQ, H,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """delta[b, h, t] = dO . O in float32."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(
        OUT + b.to(tl.int64) * stride_ob + h * stride_oh, offs_m, stride_ot, offs_d, TQ, True, HEAD_DIM
    )
    do = _load_rows(
        DO + b.to(tl.int64) * stride_dob + h * stride_doh, offs_m, stride_dot, offs_d, TQ, True, HEAD_DIM
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * TQ + offs_m, delta, mask=offs_m < TQ)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, k_pos, k_doc, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, DOC,
    lo, hi, qk_scale, window, TQ, OFFSET, offs_m, offs_d,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, SOFTPICK: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Transposed tiles ([keys, queries]) so that dK, dV accumulate as [BLOCK_N, BLOCK_D] products."""
    for start_m in range(lo, hi, BLOCK_M):
        q_rows = start_m + offs_m
        q = _load_rows(q_base, q_rows, stride_qt, offs_d, TQ, MASKED, HEAD_DIM)
        do = _load_rows(do_base, q_rows, stride_dot, offs_d, TQ, MASKED, HEAD_DIM)
        if MASKED:
            lse2 = tl.load(lse_base + q_rows, mask=q_rows < TQ, other=0.0) * LOG2E_JIT
            delta = tl.load(delta_base + q_rows, mask=q_rows < TQ, other=0.0)
        else:
            lse2 = tl.load(lse_base + q_rows) * LOG2E_JIT
            delta = tl.load(delta_base + q_rows)
        qk = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if MASKED:
            q_doc = tl.load(DOC + q_rows, mask=q_rows < TQ, other=-1) if IS_VARLEN else q_rows
            visible = tl.trans(_visible(q_rows + OFFSET, k_pos, q_doc, k_doc, window, HAS_WINDOW, IS_VARLEN))
            qk = tl.where(visible, qk, 0.0 if SOFTPICK else float("-inf"))
        e = tl.math.exp2(qk * qk_scale - lse2[None, :])
        if SOFTPICK:
            p = tl.maximum(e - tl.math.exp2(-lse2)[None, :], 0.0)
        else:
            p = tl.where(qk >= 0, e, 0.0)
        dv += tl.dot(p.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if SOFTPICK:
            ds = e * tl.where(qk > 0, dp - delta[None, :], tl.where(qk < 0, delta[None, :], 0.0))
        else:
            ds = p * (dp - delta[None, :])
        dk += tl.dot(ds.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=DKDV_CONFIGS, key=TUNING_KEY, prune_configs_by=PRUNE)
@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DOC, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    qk_scale, scale, window, TQ, TK, H, GROUP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CONFIG_TAG: tl.constexpr, SOFTPICK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    num_kv_heads = H // GROUP
    b = bhk // num_kv_heads
    hk = bhk % num_kv_heads
    offset = TK - TQ
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(
        K + b.to(tl.int64) * stride_kb + hk * stride_kh, offs_n, stride_kt, offs_d, TK, True, HEAD_DIM
    )
    v = _load_rows(
        V + b.to(tl.int64) * stride_vb + hk * stride_vh, offs_n, stride_vt, offs_d, TK, True, HEAD_DIM
    )
    k_doc = tl.load(DOC + offs_n, mask=offs_n < TK, other=-2) if IS_VARLEN else offs_n
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_ranges(
        start_n, TQ, offset, DOC, CU, window, BLOCK_M, BLOCK_N, HAS_WINDOW, IS_VARLEN
    )
    # The query heads of this key/value head's group add into the same dK, dV.
    for h in range(hk * GROUP, hk * GROUP + GROUP):
        q_base = Q + b.to(tl.int64) * stride_qb + h * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h * stride_doh
        lse_base = LSE + (b * H + h).to(tl.int64) * TQ
        delta_base = DELTA + (b * H + h).to(tl.int64) * TQ
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, offs_n, k_doc, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, DOC,
            lo, full_lo, qk_scale, window, TQ, offset, offs_m, offs_d,
            True, HEAD_DIM, BLOCK_M, SOFTPICK, IS_VARLEN, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, offs_n, k_doc, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, DOC,
            full_lo, full_hi, qk_scale, window, TQ, offset, offs_m, offs_d,
            False, HEAD_DIM, BLOCK_M, SOFTPICK, IS_VARLEN, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, offs_n, k_doc, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, DOC,
            full_hi, hi, qk_scale, window, TQ, offset, offs_m, offs_d,
            True, HEAD_DIM, BLOCK_M, SOFTPICK, IS_VARLEN, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    _store_rows(DK + b.to(tl.int64) * stride_dkb + hk * stride_dkh, dk * scale, offs_n, stride_dkt, offs_d, TK,
                HEAD_DIM)  # fmt: skip
    _store_rows(
        DV + b.to(tl.int64) * stride_dvb + hk * stride_dvh, dv, offs_n, stride_dvt, offs_d, TK, HEAD_DIM
    )


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta, q_pos, q_doc, k_base, v_base, stride_kt, stride_vt, DOC, lo, hi, qk_scale, window, TK,
    offs_n, offs_d,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SOFTPICK: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        k = _load_rows(k_base, k_pos, stride_kt, offs_d, TK, MASKED, HEAD_DIM)
        v = _load_rows(v_base, k_pos, stride_vt, offs_d, TK, MASKED, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            k_doc = tl.load(DOC + k_pos, mask=k_pos < TK, other=-2) if IS_VARLEN else k_pos
            visible = _visible(q_pos, k_pos, q_doc, k_doc, window, HAS_WINDOW, IS_VARLEN)
            qk = tl.where(visible, qk, 0.0 if SOFTPICK else float("-inf"))
        e = tl.math.exp2(qk * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if SOFTPICK:
            ds = e * tl.where(qk > 0, dp - delta[:, None], tl.where(qk < 0, delta[:, None], 0.0))
        else:
            ds = tl.where(qk >= 0, e, 0.0) * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.autotune(configs=DQ_CONFIGS, key=TUNING_KEY, prune_configs_by=PRUNE)
@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DOC, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh,
    qk_scale, scale, window, TQ, TK, H, GROUP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CONFIG_TAG: tl.constexpr, SOFTPICK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offset = TK - TQ
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(
        Q + b.to(tl.int64) * stride_qb + h * stride_qh, offs_m, stride_qt, offs_d, TQ, True, HEAD_DIM
    )
    do = _load_rows(
        DO + b.to(tl.int64) * stride_dob + h * stride_doh, offs_m, stride_dot, offs_d, TQ, True, HEAD_DIM
    )
    lse2 = tl.load(LSE + bh.to(tl.int64) * TQ + offs_m, mask=offs_m < TQ, other=0.0) * LOG2E_JIT
    delta = tl.load(DELTA + bh.to(tl.int64) * TQ + offs_m, mask=offs_m < TQ, other=0.0)
    q_pos = offs_m + offset
    q_doc = tl.load(DOC + offs_m, mask=offs_m < TQ, other=-1) if IS_VARLEN else offs_m
    k_base = K + b.to(tl.int64) * stride_kb + (h // GROUP) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + (h // GROUP) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(
        start_m, TQ, offset, DOC, CU, window, BLOCK_M, BLOCK_N, HAS_WINDOW, IS_VARLEN
    )
    dq = _dq_blocks(
        dq, q, do, lse2, delta, q_pos, q_doc, k_base, v_base, stride_kt, stride_vt, DOC, lo, full_lo, qk_scale,
        window, TK, offs_n, offs_d, True, HEAD_DIM, BLOCK_N, SOFTPICK, IS_VARLEN, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse2, delta, q_pos, q_doc, k_base, v_base, stride_kt, stride_vt, DOC, full_lo, full_hi,
        qk_scale, window, TK, offs_n, offs_d, False, HEAD_DIM, BLOCK_N, SOFTPICK, IS_VARLEN, HAS_WINDOW,
        DOT_PRECISION,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse2, delta, q_pos, q_doc, k_base, v_base, stride_kt, stride_vt, DOC, full_hi, hi, qk_scale,
        window, TK, offs_n, offs_d, True, HEAD_DIM, BLOCK_N, SOFTPICK, IS_VARLEN, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    _store_rows(DQ + b.to(tl.int64) * stride_dqb + h * stride_dqh, dq * scale, offs_m, stride_dqt, offs_d, TQ,
                HEAD_DIM)  # fmt: skip


def _documents(cu_seqlens: Tensor | None, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(document id per token [T], cu_seqlens) as int32 on the device, without a host sync; dummies without
    cu_seqlens (the kernels then never read them)."""
    if cu_seqlens is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return dummy, dummy
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    positions = torch.arange(seq_len, device=device, dtype=torch.int32)
    return torch.searchsorted(cu[1:], positions, right=True).to(torch.int32), cu


def _block_d(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128


def _common_args(q: Tensor, k: Tensor, cu_seqlens: Tensor | None, window_size: int | None, variant: str):
    _, seq_len, num_heads, head_dim = q.shape
    doc, cu = _documents(cu_seqlens, seq_len, q.device)
    constexprs = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        SOFTPICK=variant == "softpick",
        IS_VARLEN=cu_seqlens is not None,
        HAS_WINDOW=window_size is not None,
        # float32 inputs (the tests) get exact float32 products instead of TF32.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    runtime = dict(
        window=window_size or 0, TQ=seq_len, TK=k.shape[1], H=num_heads, GROUP=num_heads // k.shape[2]
    )
    return doc, cu, constexprs, runtime


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor | None,
    window_size: int | None,
    scale: float,
    variant: str,
) -> tuple[Tensor, Tensor]:
    """(o [B, Tq, H, D] in q's dtype, lse [B, H, Tq] float32); arguments as checked by `softpick_attention`."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    batch, seq_len, num_heads, head_dim = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, num_heads, seq_len, dtype=torch.float32, device=q.device)
    doc, cu, constexprs, runtime = _common_args(q, k, cu_seqlens, window_size, variant)

    def grid(meta):
        return (triton.cdiv(seq_len, meta["BLOCK_M"]), batch * num_heads)

    _fwd_kernel[grid](
        q, k, v, o, lse, doc, cu, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        qk_scale=scale * LOG2E, **runtime, **constexprs, EPS=SOFTPICK_EPS,
    )  # fmt: skip
    return o, lse


softpick_attention_fwd = torch.library.custom_op("flame::softpick_attention_fwd", _forward, mutates_args=())


@softpick_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, window_size, scale, variant):
    batch, seq_len, num_heads, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        batch, num_heads, seq_len, dtype=torch.float32
    )


@torch.library.custom_op("flame::softpick_attention_bwd", mutates_args=())
def softpick_attention_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor | None,
    window_size: int | None,
    scale: float,
    variant: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the dtypes of q, k, v, from the forward's o and lse."""
    do, q, k, v, o = (_last_dim_contiguous(x) for x in (do, q, k, v, o))
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    key_len = k.shape[1]
    doc, cu, constexprs, runtime = _common_args(q, k, cu_seqlens, window_size, variant)
    delta = torch.empty_like(lse)
    block_d = constexprs["BLOCK_D"]
    preprocess_rows = 16 if INTERPRETED else 64
    _bwd_preprocess[(triton.cdiv(seq_len, preprocess_rows), batch * num_heads)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], seq_len, num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=preprocess_rows,
    )  # fmt: skip
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])

    def dkdv_grid(meta):
        return (triton.cdiv(key_len, meta["BLOCK_N"]), batch * num_kv_heads)

    def dq_grid(meta):
        return (triton.cdiv(seq_len, meta["BLOCK_M"]), batch * num_heads)

    _dkdv_kernel[dkdv_grid](
        q, k, v, do, lse, delta, dk, dv, doc, cu, *common, *dk.stride()[:3], *dv.stride()[:3],
        qk_scale=scale * LOG2E, scale=scale, **runtime, **constexprs,
    )  # fmt: skip
    _dq_kernel[dq_grid](
        q, k, v, do, lse, delta, dq, doc, cu, *common, *dq.stride()[:3],
        qk_scale=scale * LOG2E, scale=scale, **runtime, **constexprs,
    )  # fmt: skip
    return dq, dk, dv


@softpick_attention_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, window_size, scale, variant):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, window_size, scale, variant = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.window_size, ctx.scale, ctx.variant = window_size, scale, variant
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = softpick_attention_bwd(
        do, q, k, v, o, lse, cu_seqlens, ctx.window_size, ctx.scale, ctx.variant
    )
    return dq, dk, dv, None, None, None, None


# Eager calls run the kernels through an autograd.Function, compiled graphs through the ops.
_softpick_attention = differentiable_op(softpick_attention_fwd, _forward, _setup_context, _backward)


def check_arguments(
    q: Tensor, k: Tensor, v: Tensor, window_size: int | None, cu_seqlens: Tensor | None, variant
):
    """ValueError for what the kernel does not support, each in one line saying what to do instead."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if q.dim() != 4 or k.shape != v.shape or q.shape[::3] != k.shape[::3]:
        raise ValueError(
            f"expected q [B, Tq, H, D] and k, v [B, Tk, HKV, D] of one head dim, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_query_key_lengths(q.shape[1], k.shape[1], causal=True, packed=cu_seqlens is not None)
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"the softpick Triton kernel supports head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]}: use smaller "
            "heads, or call flame.ops.attention.reference_attention (O(T^2) memory)"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q, k, v must share one of float16/bfloat16/float32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if window_size is not None and window_size < 1:
        raise ValueError(f"window_size must be >= 1, got {window_size}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"a packed batch (cu_seqlens given) must have batch size 1, got {q.shape[0]}")


def softpick_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    variant: str = "softpick",
    window_size: int | None = None,
    cu_seqlens: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Causal softpick (or rectified-softmax) attention, [B, Tq, H, D], queries aligned to the end of the keys;
    differentiable in q, k, v."""
    check_arguments(q, k, v, window_size, cu_seqlens, variant)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if scale <= 0:
        raise ValueError(f"scale must be positive (the kernel reads score signs off q . k), got {scale}")
    return _softpick_attention(q, k, v, cu_seqlens, window_size, float(scale), variant)[0]
