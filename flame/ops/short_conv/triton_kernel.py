"""flame's Triton kernels for the causal depthwise short convolution (the q/k/v "short conv" of (Gated) DeltaNet).

    short_conv_triton(x, weight, bias, activation, cu_seqlens) -> y
    y[b, t, d] = act( bias[d] + sum_{i=0}^{W-1} weight[d, W-1-i] * x[b, t-i, d] )
    short_conv_group_triton([(x, weight, bias), ...], activation, cu_seqlens) -> [y, ...]

Same contract as `short_conv_torch` in reference.py, which the tests compare against: x [B, T, D] (float16 /
bfloat16 / float32 / float64; a last dim with stride != 1 is copied), weight [D, W] or [D, 1, W] with
1 <= W <= 8, bias [D] or None, activation None / "silu" / "swish"; cu_seqlens (int32/int64 [N + 1], batch 1) packs
documents, and a tap reaching i tokens back is dropped where the token is fewer than i positions into its document
(at the row start in a batch). cu_seqlens[-1] must equal T; it is not checked (that would need a host sync). Sums
run in float32 (float64 for float64 inputs); y and dx are in x's dtype, dweight and dbias in the dtypes and shapes
of weight and bias.

A group is up to MAX_GROUP convolutions of one B, T, dtype, width and bias presence, each with its own channel
count (a DeltaNet layer's q, k and v): each kernel runs once for all, grid axis 1 walking through the first
member's channel blocks, then the second's and the third's; a program picks its member's pointers and strides.
A member's results are its own call's bit for bit in one launch setting (a group tunes apart from its members).
The group saves the host 2 of 3 op calls and launches, which bound GatedDeltaNet's step on some hosts.

Why: FLA 0.6.0's `causal_conv1d` runs at about 4x the memory-bandwidth floor of this op. The op is memory-bound
only if each element costs a few tens of instructions, so the kernels read each x (and dy) element once into
registers and keep what neighbouring tokens need there instead of re-reading or recomputing it:
- A program owns ROWS x BLOCK_D lanes (ROWS spans of SPAN consecutive tokens, BLOCK_D channels) and walks its
  spans one token per step, all rows at once: a [ROWS, BLOCK_D] tile per step, each row a contiguous, coalesced
  run of channels. x of the last W-1 tokens rides along in registers (a tuple), so the forward reads x once
  (plus W-1 tokens before each span) and computes z = bias + sum_i weight[W-1-i] x[t-i], y = act(z).
- The backward walks the same way, computing z and dz = dy * act'(z) once per token and keeping dz of the last
  W-1 tokens, so that dx[t] = sum_w weight[W-1-w] dz[t+w] [pos[t+w] >= w] is complete W-1 steps after t (a span
  runs W-1 steps past its end for that). dweight[:, W-1-i] += dz[t] x[t-i] [pos[t] >= i] and dbias += dz[t]
  accumulate in registers; each program writes one float32 partial row ([chunks, W, D] and [chunks, D], a chunk
  being the ROWS * SPAN tokens of one program), and a second small kernel sums the rows in order: no atomics,
  deterministic.
(Recomputing z at the W shifted tokens of a tile instead costs W sigmoids per element: ~200 SASS instructions per
element for W = 4 in the sm_90 build, compute-bound; the walk takes ~17 (forward) and ~32 (backward).)

In a packed row, a small kernel first finds each token's position in its document by a binary search over
cu_seqlens (on the device, no host sync); a batch row needs none (position = t, and the loads already read 0 before
the row start).

Under torch.compile the kernels run as the torch custom ops `torch.ops.flame.short_conv_fwd` / `_bwd` (one node
each for a whole group, autograd registered on the forward); eager calls run the same code as an autograd.Function
(flame.ops.custom_ops), which costs the host less than the op's dispatch. With TRITON_INTERPRET=1 set before this
module is imported, the kernels run in Triton's CPU interpreter with one small block configuration (the CPU tests
do that).
"""

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from flame.ops.custom_ops import differentiable_op
from flame.ops.short_conv.reference import ACTIVATIONS, MAX_GROUP, as_depthwise_taps

MAX_WIDTH = 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Kernels read globals only as constexprs. Token steps per unrolled loop body: the histories rotate by renaming
# registers instead of moves, and the loop overhead is shared.
UNROLL = tl.constexpr(4)
# The interpreter runs no PTX: it gets tl.sigmoid.
FAST_SIGMOID = tl.constexpr(not INTERPRETED)
LOG2E = tl.constexpr(1.4426950408889634)


def _configs(choices: list[tuple[int, int, int, int, int]]) -> list[triton.Config]:
    """(ROWS, SPAN, BLOCK_D, num_warps, STAGES): STAGES > 1 has Triton prefetch the tiles of later token steps
    into shared memory (cp.async), the memory-level parallelism that a thread walking its tokens in order lacks
    (without it the forward measured 2.0x and the backward 2.7x the bandwidth floor on an H200)."""
    return [
        triton.Config({"ROWS": rows, "SPAN": span, "BLOCK_D": block_d, "STAGES": stages}, num_warps=warps)
        for rows, span, block_d, warps, stages in choices
    ]


if INTERPRETED:
    # Small blocks so that the CPU tests cross span, chunk and channel block edges quickly.
    FWD_CONFIGS = BWD_CONFIGS = _configs([(4, 8, 32, 1, 1)])
else:
    # Few configs: every one is compiled and timed once per tuning key on a fresh machine; these were the fastest
    # of a sweep on an H200 (x [8, 2048, 1536 / 3072] bfloat16, W = 4). ROWS x BLOCK_D is 4 elements per thread
    # (one 8- or 16-byte vector per row step), which leaves registers for the histories; STAGES 3-4 prefetch 2-3
    # unrolled iterations. The backward favours long spans (less halo and fewer partial rows: 128-token spans
    # measured 1.32-1.39x the bandwidth floor, 64-token ones 1.46-1.64x); short chunks keep small inputs spread
    # over the GPU.
    FWD_CONFIGS = _configs([(8, 32, 64, 4, 4), (4, 64, 128, 4, 3), (8, 64, 128, 8, 3), (8, 32, 128, 4, 3)])
    BWD_CONFIGS = _configs([(8, 128, 64, 4, 4), (4, 128, 64, 2, 4), (8, 64, 64, 4, 4), (8, 32, 64, 4, 4)])
# A backward program sums the tokens of one chunk (ROWS * SPAN of a row) into one partial dweight / dbias row; the
# partial buffer has room for the shortest chunk.
MIN_CHUNK = min(c.kwargs["ROWS"] * c.kwargs["SPAN"] for c in BWD_CONFIGS)
# The autotuner adds the tensors' dtypes. The best chunk length depends on how many programs there are, so the key
# holds the token count B x T rounded up to a power of two (`_tokens_bucket`): T itself would tune again for every
# new length, e.g. at each step of text sampling, where the sequence grows by one token per forward.
TUNING_KEY = ["TOKENS_BUCKET", "D0", "D1", "D2", "W", "NUM", "HAS_BIAS", "SILU", "IS_VARLEN"]


@triton.jit
def _sigmoid(z):
    """1 / (1 + 2^(-z log2 e)) with flush-to-zero approximate ex2 and rcp (2 ulp): 4 instructions, where tl.sigmoid
    spends 12 on denormal and overflow fix-ups that do not change a sigmoid."""
    if FAST_SIGMOID and z.dtype == tl.float32:
        e = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [z * -LOG2E], dtype=tl.float32, is_pure=True, pack=1
        )
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
        )
    return tl.sigmoid(z)


@triton.jit
def _load(base, rel, t, stride_t, T, cols, col_ok, ACC: tl.constexpr):
    """[ROWS, BLOCK_D] tile at tokens t (rel = t minus the token base points at), 0 outside [0, T)."""
    ok = (t >= 0) & (t < T)
    ptrs = base + rel[:, None] * stride_t + cols[None, :]
    return tl.load(ptrs, mask=ok[:, None] & col_ok[None, :], other=0.0).to(ACC)


@triton.jit
def _positions(POS, t, T, IS_VARLEN: tl.constexpr):
    """Positions of tokens t inside their documents (t itself in a batch row)."""
    if IS_VARLEN:
        return tl.load(POS + t, mask=(t >= 0) & (t < T), other=0)
    return t


@triton.jit
def _taps(WEIGHT, cols, col_ok, stride_wd, stride_ww, W: tl.constexpr, ACC: tl.constexpr):
    """(weight[cols, 0], ..., weight[cols, W-1]) as [1, BLOCK_D] rows (read once per program)."""
    taps = ()
    for j in tl.static_range(W):
        taps = taps + (
            tl.load(WEIGHT + cols * stride_wd + j * stride_ww, mask=col_ok, other=0.0).to(ACC)[None, :],
        )
    return taps


@triton.jit
def _push(history, value):
    """(value, history[0], ..., history[-2]): the newest first, the oldest dropped."""
    pushed = (value,)
    for j in tl.static_range(len(history) - 1):
        pushed = pushed + (history[j],)
    return pushed


@triton.jit
def _back(x, x_history, i: tl.constexpr):
    """x[t - i] from the current x and x_history[i-1] = x[t - i]."""
    if i == 0:
        return x
    else:
        return x_history[i - 1]


@triton.jit
def _tap_input(x_back, pos, i: tl.constexpr, IS_VARLEN: tl.constexpr):
    """x[t - i] as tap i of token t sees it: 0 when t is fewer than i tokens into its document. In a batch row
    the load already gave 0 before the row start."""
    if IS_VARLEN:
        return tl.where((pos >= i)[:, None], x_back, 0.0)
    return x_back


@triton.jit
def _preactivation(
    x, x_history, pos, taps, bias, W: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr
):
    """z = bias + sum_i weight[W-1-i] x[t-i]; x_history[i-1] = x[t-i]."""
    z = x * taps[W - 1]
    for i in tl.static_range(1, W):
        z += _tap_input(x_history[i - 1], pos, i, IS_VARLEN) * taps[W - 1 - i]
    if HAS_BIAS:
        z += bias
    return z


@triton.jit
def _member(D0, D1, NUM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(is member 1, is member 2, channel block inside the member) of this program: grid axis 1 counts member 0's
    channel blocks, then member 1's, then member 2's."""
    block = tl.program_id(1)
    in_1 = block < 0
    in_2 = block < 0
    if NUM >= 2:
        first_1 = tl.cdiv(D0, BLOCK_D)
        in_1 = block >= first_1
        if NUM == 3:
            first_2 = first_1 + tl.cdiv(D1, BLOCK_D)
            in_2 = block >= first_2
            block -= tl.where(in_2, first_2, tl.where(in_1, first_1, 0))
        else:
            block -= tl.where(in_1, first_1, 0)
    return in_1, in_2, block


@triton.jit
def _pick(in_1, in_2, value0, value1, value2, NUM: tl.constexpr):
    """The program's member's value (pointer, size or stride): value0, value1 or value2."""
    if NUM == 1:
        return value0
    elif NUM == 2:
        return tl.where(in_1, value1, value0)
    else:
        return tl.where(in_2, value2, tl.where(in_1, value1, value0))


@triton.autotune(configs=FWD_CONFIGS, key=TUNING_KEY)
@triton.jit(do_not_specialize=["TOKENS_BUCKET"])
def _fwd_kernel(
    X0, X1, X2, WEIGHT0, WEIGHT1, WEIGHT2, BIAS0, BIAS1, BIAS2, POS, Y0, Y1, Y2, T, D0, D1, D2, TOKENS_BUCKET,
    stride_x0b, stride_x0t, stride_x1b, stride_x1t, stride_x2b, stride_x2t,
    stride_y0b, stride_y0t, stride_y1b, stride_y1t, stride_y2b, stride_y2t,
    W: tl.constexpr, NUM: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, IS_VARLEN: tl.constexpr,
    ROWS: tl.constexpr, SPAN: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    ACC: tl.constexpr = tl.float64 if X0.dtype.element_ty == tl.float64 else tl.float32
    in_1, in_2, block = _member(D0, D1, NUM, BLOCK_D)
    X = _pick(in_1, in_2, X0, X1, X2, NUM)
    Y = _pick(in_1, in_2, Y0, Y1, Y2, NUM)
    WEIGHT = _pick(in_1, in_2, WEIGHT0, WEIGHT1, WEIGHT2, NUM)
    D = _pick(in_1, in_2, D0, D1, D2, NUM)
    stride_xt = _pick(in_1, in_2, stride_x0t, stride_x1t, stride_x2t, NUM)
    stride_yt = _pick(in_1, in_2, stride_y0t, stride_y1t, stride_y2t, NUM)
    start = tl.program_id(0) * (ROWS * SPAN)
    cols = block * BLOCK_D + tl.arange(0, BLOCK_D)
    b = tl.program_id(2).to(tl.int64)
    col_ok = cols < D
    # Token offsets inside the program stay small; its base is computed in int64.
    x_base = (
        X + b * _pick(in_1, in_2, stride_x0b, stride_x1b, stride_x2b, NUM) + start.to(tl.int64) * stride_xt
    )
    y_base = (
        Y + b * _pick(in_1, in_2, stride_y0b, stride_y1b, stride_y2b, NUM) + start.to(tl.int64) * stride_yt
    )
    span_first = tl.arange(0, ROWS) * SPAN
    taps = _taps(WEIGHT, cols, col_ok, W, 1, W, ACC)
    BIAS = _pick(in_1, in_2, BIAS0, BIAS1, BIAS2, NUM) if HAS_BIAS else None
    bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(ACC)[None, :] if HAS_BIAS else 0.0
    x_history = ()  # x at the W-1 tokens before the current one, newest first
    for i in tl.static_range(1, W):
        x_history = x_history + (
            _load(x_base, span_first - i, start + span_first - i, stride_xt, T, cols, col_ok, ACC),
        )
    for k in tl.range(SPAN, num_stages=STAGES, loop_unroll_factor=UNROLL):
        rel = span_first + k
        t = start + rel
        x = _load(x_base, rel, t, stride_xt, T, cols, col_ok, ACC)
        z = _preactivation(x, x_history, _positions(POS, t, T, IS_VARLEN), taps, bias, W, HAS_BIAS, IS_VARLEN)
        if SILU:
            z = z * _sigmoid(z)
        tl.store(y_base + rel[:, None] * stride_yt + cols[None, :], z.to(Y.dtype.element_ty),
                 mask=(t < T)[:, None] & col_ok[None, :])  # fmt: skip
        x_history = _push(x_history, x)


@triton.jit
def _bwd_step(
    x_base, dy_base, rel, t, POS, T, cols, col_ok, stride_xt, stride_dyt, x_history, taps, bias,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, IS_VARLEN: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """(x, position, dz) at tokens t; dz is 0 past T (dy reads 0 there)."""
    x = _load(x_base, rel, t, stride_xt, T, cols, col_ok, ACC)
    pos = _positions(POS, t, T, IS_VARLEN)
    dz = _load(dy_base, rel, t, stride_dyt, T, cols, col_ok, ACC)
    if SILU:
        z = _preactivation(x, x_history, pos, taps, bias, W, HAS_BIAS, IS_VARLEN)
        sig = _sigmoid(z)
        dz *= sig * (1.0 + z * (1.0 - sig))
    return x, pos, dz


@triton.jit
def _dx(dz, pos, dz_history, pos_history, taps, W: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dx at the token W-1 steps back, u = t - (W-1): y[u + w] read x[u] through tap W-1-w when u + w is at least
    w tokens into its document; dz[u + w] is dz (w = W-1) or dz_history[W-2-w]. In a batch row that holds for
    every u >= 0 (the only ones stored)."""
    dx = _tap_input(dz, pos, W - 1, IS_VARLEN) * taps[0]
    for m in tl.static_range(1, W):
        dx += _tap_input(dz_history[m - 1], pos_history[m - 1], W - 1 - m, IS_VARLEN) * taps[m]
    return dx


@triton.autotune(configs=BWD_CONFIGS, key=TUNING_KEY)
@triton.jit(do_not_specialize=["TOKENS_BUCKET"])
def _bwd_kernel(
    X0, X1, X2, DY0, DY1, DY2, WEIGHT0, WEIGHT1, WEIGHT2, BIAS0, BIAS1, BIAS2, POS, DX0, DX1, DX2,
    DW_PARTIAL, DB_PARTIAL, T, D0, D1, D2, TOKENS_BUCKET,
    stride_x0b, stride_x0t, stride_x1b, stride_x1t, stride_x2b, stride_x2t,
    stride_dy0b, stride_dy0t, stride_dy1b, stride_dy1t, stride_dy2b, stride_dy2t,
    stride_dx0b, stride_dx0t, stride_dx1b, stride_dx1t, stride_dx2b, stride_dx2t,
    W: tl.constexpr, NUM: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, IS_VARLEN: tl.constexpr,
    ROWS: tl.constexpr, SPAN: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    ACC: tl.constexpr = tl.float64 if X0.dtype.element_ty == tl.float64 else tl.float32
    in_1, in_2, block = _member(D0, D1, NUM, BLOCK_D)
    X = _pick(in_1, in_2, X0, X1, X2, NUM)
    DY = _pick(in_1, in_2, DY0, DY1, DY2, NUM)
    DX = _pick(in_1, in_2, DX0, DX1, DX2, NUM)
    WEIGHT = _pick(in_1, in_2, WEIGHT0, WEIGHT1, WEIGHT2, NUM)
    D = _pick(in_1, in_2, D0, D1, D2, NUM)
    stride_xt = _pick(in_1, in_2, stride_x0t, stride_x1t, stride_x2t, NUM)
    stride_dyt = _pick(in_1, in_2, stride_dy0t, stride_dy1t, stride_dy2t, NUM)
    stride_dxt = _pick(in_1, in_2, stride_dx0t, stride_dx1t, stride_dx2t, NUM)
    start = tl.program_id(0) * (ROWS * SPAN)
    cols = block * BLOCK_D + tl.arange(0, BLOCK_D)
    b = tl.program_id(2).to(tl.int64)
    col_ok = cols < D
    start64 = start.to(tl.int64)
    x_base = X + b * _pick(in_1, in_2, stride_x0b, stride_x1b, stride_x2b, NUM) + start64 * stride_xt
    dy_base = DY + b * _pick(in_1, in_2, stride_dy0b, stride_dy1b, stride_dy2b, NUM) + start64 * stride_dyt
    dx_base = DX + b * _pick(in_1, in_2, stride_dx0b, stride_dx1b, stride_dx2b, NUM) + start64 * stride_dxt
    # The partial rows hold the members' channels one after the other.
    partial_cols = _pick(in_1, in_2, 0, D0, D0 + D1, NUM) + cols
    D_ALL = D0 + D1 + D2
    span_first = tl.arange(0, ROWS) * SPAN
    taps = _taps(WEIGHT, cols, col_ok, W, 1, W, ACC)
    BIAS = _pick(in_1, in_2, BIAS0, BIAS1, BIAS2, NUM) if HAS_BIAS else None
    bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(ACC)[None, :] if HAS_BIAS else 0.0
    # Histories of the last W-1 tokens, newest first. dz (and its positions) before the span reach no stored dx.
    zeros = tl.zeros([ROWS, BLOCK_D], dtype=ACC)
    x_history = ()
    dz_history = ()
    pos_history = ()
    for i in tl.static_range(1, W):
        x_history = x_history + (
            _load(x_base, span_first - i, start + span_first - i, stride_xt, T, cols, col_ok, ACC),
        )
        dz_history = dz_history + (zeros,)
        pos_history = pos_history + (span_first,)
    # dweight[:, j] (tap j reads x[t - (W-1-j)]) and dbias of this program's tokens, per lane.
    dw = ()
    for _ in tl.static_range(W):
        dw = dw + (zeros,)
    db = zeros
    for k in tl.range(SPAN, num_stages=STAGES, loop_unroll_factor=UNROLL):
        rel = span_first + k
        t = start + rel
        x, pos, dz = _bwd_step(
            x_base, dy_base, rel, t, POS, T, cols, col_ok, stride_xt, stride_dyt, x_history, taps, bias,
            W, HAS_BIAS, SILU, IS_VARLEN, ACC,
        )  # fmt: skip
        new_dw = ()
        for j in tl.static_range(W):
            new_dw = new_dw + (
                dw[j] + dz * _tap_input(_back(x, x_history, W - 1 - j), pos, W - 1 - j, IS_VARLEN),
            )
        dw = new_dw
        if HAS_BIAS:
            db += dz
        # The first W-1 steps complete no dx of this span.
        u = rel - (W - 1)
        dx = _dx(dz, pos, dz_history, pos_history, taps, W, IS_VARLEN)
        tl.store(dx_base + u[:, None] * stride_dxt + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=((u >= span_first) & (start + u < T))[:, None] & col_ok[None, :])  # fmt: skip
        x_history = _push(x_history, x)
        dz_history = _push(dz_history, dz)
        pos_history = _push(pos_history, pos)
    # W-1 steps past the span (tokens of the next span, or past T) complete its last dx.
    for m in tl.static_range(W - 1):
        rel = span_first + SPAN + m
        t = start + rel
        x, pos, dz = _bwd_step(
            x_base, dy_base, rel, t, POS, T, cols, col_ok, stride_xt, stride_dyt, x_history, taps, bias,
            W, HAS_BIAS, SILU, IS_VARLEN, ACC,
        )  # fmt: skip
        u = rel - (W - 1)
        dx = _dx(dz, pos, dz_history, pos_history, taps, W, IS_VARLEN)
        tl.store(dx_base + u[:, None] * stride_dxt + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=((u >= span_first) & (start + u < T))[:, None] & col_ok[None, :])  # fmt: skip
        x_history = _push(x_history, x)
        dz_history = _push(dz_history, dz)
        pos_history = _push(pos_history, pos)
    partial = b * tl.num_programs(0) + tl.program_id(0)
    for j in tl.static_range(W):
        tl.store(DW_PARTIAL + (partial * W + j) * D_ALL + partial_cols, tl.sum(dw[j], 0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial * D_ALL + partial_cols, tl.sum(db, 0), mask=col_ok)


@triton.jit
def _positions_kernel(CU, POS, T, NUM_DOCS, SEARCH_STEPS, BLOCK: tl.constexpr):
    """POS[t] = t - cu[j] for the largest j with cu[j] <= t (a binary search over cu per token; the last of equal
    starts, so empty documents are skipped)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int32)  # cu[lo] <= t throughout
    hi = tl.zeros([BLOCK], dtype=tl.int32) + NUM_DOCS
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        below = tl.load(CU + mid) <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    tl.store(POS + t, t - tl.load(CU + lo), mask=t < T)


@triton.jit
def _sum_partials_kernel(
    DW_PARTIAL, DB_PARTIAL, DW, DB, NUM_PARTIALS, D, stride_wd, stride_ww,
    W: tl.constexpr, W_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dweight [D, W] (strides as given) and dbias [D] in their dtypes: the partial rows summed in order."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    taps = tl.arange(0, W_PAD)
    ok = (taps < W)[:, None] & (cols < D)[None, :]
    dw = tl.zeros([W_PAD, BLOCK_D], dtype=DW_PARTIAL.dtype.element_ty)
    db = tl.zeros([BLOCK_D], dtype=DW_PARTIAL.dtype.element_ty)
    for row in range(NUM_PARTIALS):
        dw += tl.load(DW_PARTIAL + (row * W + taps[:, None]) * D + cols[None, :], mask=ok, other=0.0)
        if HAS_BIAS:
            db += tl.load(DB_PARTIAL + row * D + cols, mask=cols < D, other=0.0)
    tl.store(DW + cols[None, :] * stride_wd + taps[:, None] * stride_ww, dw.to(DW.dtype.element_ty), mask=ok)
    if HAS_BIAS:
        tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=cols < D)


def _positions_in_documents(cu_seqlens: Tensor | None, seq_len: int, device: torch.device) -> Tensor | None:
    """Position of each packed token inside its document, int32 [T], computed on the device (no host sync)."""
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    positions = torch.empty(seq_len, dtype=torch.int32, device=device)
    num_docs = cu.shape[0] - 1
    block = 64 if INTERPRETED else 1024
    _positions_kernel[(triton.cdiv(seq_len, block),)](
        cu, positions, seq_len, num_docs, num_docs.bit_length(), BLOCK=block
    )
    return positions


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _tokens_bucket(batch: int, seq_len: int) -> int:
    """The autotuning key's token count (TUNING_KEY): B x T rounded up to a power of two."""
    return triton.next_power_of_2(batch * seq_len)


def _members(
    x0, weight0, bias0, x1, weight1, bias1, x2, weight2, bias2
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The present members' (x with a unit last stride, taps [D, W] contiguous, bias)."""
    return [
        (_last_dim_contiguous(x), as_depthwise_taps(weight).contiguous(), bias)
        for x, weight, bias in ((x0, weight0, bias0), (x1, weight1, bias1), (x2, weight2, bias2))
        if x is not None
    ]


def _padded(values: list, fill=None) -> list:
    """``values`` filled up to MAX_GROUP entries: the kernels' argument slots of absent members."""
    return [*values, *[fill] * (MAX_GROUP - len(values))]


def _absent(like: Tensor, present: int) -> list[Tensor]:
    """The empty outputs of the absent members (a custom op returns tensors, each its own)."""
    return [like.new_empty(0) for _ in range(MAX_GROUP - present)]


def _strides(tensors: list[Tensor]) -> list[int]:
    """Each member's batch and token strides, 0 for absent members."""
    return [stride for t in tensors for stride in t.stride()[:2]] + [0, 0] * (MAX_GROUP - len(tensors))


def _flags(members: list, activation: str | None, cu_seqlens: Tensor | None) -> dict:
    return dict(
        W=members[0][1].shape[1],
        NUM=len(members),
        HAS_BIAS=members[0][2] is not None,
        SILU=activation is not None,
        IS_VARLEN=cu_seqlens is not None,
    )


def _grid(members: list, batch: int, seq_len: int):
    """Token chunks x the members' channel blocks one after the other x batch rows."""
    dims = [x.shape[2] for x, _, _ in members]

    def grid(meta):
        blocks = sum(triton.cdiv(dim, meta["BLOCK_D"]) for dim in dims)
        return (triton.cdiv(seq_len, meta["ROWS"] * meta["SPAN"]), blocks, batch)

    return grid


def _forward(
    x0: Tensor,
    weight0: Tensor,
    bias0: Tensor | None,
    x1: Tensor | None,
    weight1: Tensor | None,
    bias1: Tensor | None,
    x2: Tensor | None,
    weight2: Tensor | None,
    bias2: Tensor | None,
    activation: str | None,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(y0, y1, y2), each [B, T, D_i] in x's dtype, empty for an absent member; arguments as checked by
    `short_conv_group_triton`."""
    members = _members(x0, weight0, bias0, x1, weight1, bias1, x2, weight2, bias2)
    xs, taps, biases = (list(column) for column in zip(*members))
    batch, seq_len = x0.shape[:2]
    ys = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
    positions = _positions_in_documents(cu_seqlens, seq_len, x0.device)
    _fwd_kernel[_grid(members, batch, seq_len)](
        *_padded(xs), *_padded(taps), *_padded(biases), positions, *_padded(ys),
        seq_len, *_padded([x.shape[2] for x in xs], 0), _tokens_bucket(batch, seq_len),
        *_strides(xs), *_strides(ys),
        **_flags(members, activation, cu_seqlens),
    )  # fmt: skip
    return (*ys, *_absent(x0, len(ys)))


short_conv_fwd = torch.library.custom_op("flame::short_conv_fwd", _forward, mutates_args=())


@short_conv_fwd.register_fake
def _(x0, weight0, bias0, x1, weight1, bias1, x2, weight2, bias2, activation, cu_seqlens):
    xs = [x for x in (x0, x1, x2) if x is not None]
    return (*[torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs], *_absent(x0, len(xs)))


@torch.library.custom_op("flame::short_conv_bwd", mutates_args=())
def short_conv_bwd(
    dy0: Tensor,
    dy1: Tensor | None,
    dy2: Tensor | None,
    x0: Tensor,
    weight0: Tensor,
    bias0: Tensor | None,
    x1: Tensor | None,
    weight1: Tensor | None,
    bias1: Tensor | None,
    x2: Tensor | None,
    weight2: Tensor | None,
    bias2: Tensor | None,
    activation: str | None,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx0, dx1, dx2, dweight, dbias): each member's dx in the dtype and shape of its x (empty for an absent
    member); dweight [D0 + D1 + D2, W] in the weights' dtype and dbias [D0 + D1 + D2] in the biases' (empty
    without biases), the members' channels one after the other (a custom op returns tensors, none a view of
    another)."""
    members = _members(x0, weight0, bias0, x1, weight1, bias1, x2, weight2, bias2)
    xs, taps, biases = (list(column) for column in zip(*members))
    dys = [_last_dim_contiguous(dy) for dy in (dy0, dy1, dy2)[: len(members)]]
    batch, seq_len = x0.shape[:2]
    width = taps[0].shape[1]
    dims = [x.shape[2] for x in xs]
    dxs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
    partial_dtype = torch.float64 if x0.dtype == torch.float64 else torch.float32
    max_partials = batch * triton.cdiv(seq_len, MIN_CHUNK)
    dw_partial = x0.new_empty(max_partials, width, sum(dims), dtype=partial_dtype)
    db_partial = x0.new_empty(max_partials, sum(dims), dtype=partial_dtype) if bias0 is not None else None
    positions = _positions_in_documents(cu_seqlens, seq_len, x0.device)
    _bwd_kernel[_grid(members, batch, seq_len)](
        *_padded(xs), *_padded(dys), *_padded(taps), *_padded(biases), positions, *_padded(dxs),
        dw_partial, db_partial, seq_len, *_padded(dims, 0), _tokens_bucket(batch, seq_len),
        *_strides(xs), *_strides(dys), *_strides(dxs),
        **_flags(members, activation, cu_seqlens),
    )  # fmt: skip
    dweight = x0.new_empty(sum(dims), width, dtype=weight0.dtype)
    dbias = x0.new_empty(0) if bias0 is None else x0.new_empty(sum(dims), dtype=bias0.dtype)
    # The config the autotuner ran (just now), hence the number of partial rows written.
    chosen = _bwd_kernel.best_config.kwargs
    num_partials = batch * triton.cdiv(seq_len, chosen["ROWS"] * chosen["SPAN"])
    block_d = 64 if INTERPRETED else 256
    _sum_partials_kernel[(triton.cdiv(sum(dims), block_d),)](
        dw_partial, db_partial, dweight, dbias, num_partials, sum(dims), *dweight.stride(),
        W=width, W_PAD=triton.next_power_of_2(width), HAS_BIAS=bias0 is not None, BLOCK_D=block_d,
    )  # fmt: skip
    return (*dxs, *_absent(x0, len(dxs)), dweight, dbias)


@short_conv_bwd.register_fake
def _(dy0, dy1, dy2, x0, weight0, bias0, x1, weight1, bias1, x2, weight2, bias2, activation, cu_seqlens):
    xs = [x for x in (x0, x1, x2) if x is not None]
    channels = sum(x.shape[2] for x in xs)
    return (
        *[torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs],
        *_absent(x0, len(xs)),
        x0.new_empty(channels, weight0.shape[-1], dtype=weight0.dtype),
        x0.new_empty(0) if bias0 is None else x0.new_empty(channels, dtype=bias0.dtype),
    )


def _setup_context(ctx, inputs, output):
    *members, activation, cu_seqlens = inputs
    ctx.save_for_backward(*members, cu_seqlens)
    ctx.activation = activation


def _backward(ctx, *dys):
    *members, cu_seqlens = ctx.saved_tensors
    xs = members[0::3]
    # An output the loss does not use may come without a gradient.
    dys = [None if x is None else torch.zeros_like(x) if dy is None else dy for x, dy in zip(xs, dys)]
    *dxs, dweight, dbias = short_conv_bwd(*dys, *members, ctx.activation, cu_seqlens)
    grads, first = [], 0
    for x, weight, bias, dx in zip(xs, members[1::3], members[2::3], dxs):
        if x is None:
            grads += [None, None, None]
            continue
        channels = slice(first, first + x.shape[2])
        grads += [dx, dweight[channels].view(weight.shape), None if bias is None else dbias[channels]]
        first += x.shape[2]
    return (*grads, None, None)


# Eager calls run the kernels through an autograd.Function, compiled graphs through the ops.
_short_conv = differentiable_op(short_conv_fwd, _forward, _setup_context, _backward)


def short_conv_group_triton(
    members: Sequence[tuple[Tensor, Tensor, Tensor | None]],
    activation: str | None,
    cu_seqlens: Tensor | None,
) -> list[Tensor]:
    """Each member's causal depthwise conv (x [B, T, D_i], weight, bias; the module docstring) in one launch of
    each kernel: up to MAX_GROUP members of one batch size, length, dtype, width and bias presence; differentiable
    in every x, weight and bias."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not 1 <= len(members) <= MAX_GROUP:
        raise ValueError(
            f"the short-conv kernel takes 1 to {MAX_GROUP} convolutions at once, got {len(members)}"
        )
    x0, weight0, bias0 = members[0]
    for x, weight, bias in members:
        taps = as_depthwise_taps(weight)
        if x.ndim != 3 or taps.shape[0] != x.shape[2]:
            raise ValueError(
                f"expected x [B, T, D] and weight [D, W], got {tuple(x.shape)}, {tuple(weight.shape)}"
            )
        if not 1 <= taps.shape[1] <= MAX_WIDTH:
            raise ValueError(f"the short-conv kernel supports widths 1 to {MAX_WIDTH}, got {taps.shape[1]}")
        if bias is not None and bias.shape != (x.shape[2],):
            raise ValueError(f"bias must be [D] = [{x.shape[2]}], got {tuple(bias.shape)}")
        if (x.shape[:2], x.dtype, weight.dtype, taps.shape[1], bias is None) != (
            x0.shape[:2], x0.dtype, weight0.dtype, as_depthwise_taps(weight0).shape[1], bias0 is None
        ) or (bias is not None and bias.dtype != bias0.dtype):  # fmt: skip
            raise ValueError(
                "convolutions run together must share batch size, length, dtypes, width and bias presence"
            )
    if cu_seqlens is not None and x0.shape[0] != 1:
        raise ValueError(f"a packed batch (cu_seqlens given) must have batch size 1, got {x0.shape[0]}")
    absent = [None, None, None] * (MAX_GROUP - len(members))
    outputs = _short_conv(*[t for member in members for t in member], *absent, activation, cu_seqlens)
    return list(outputs[: len(members)])


def short_conv_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None,
    cu_seqlens: Tensor | None,
) -> Tensor:
    """Causal depthwise conv [B, T, D] -> [B, T, D] (module docstring); differentiable in x, weight and bias."""
    return short_conv_group_triton([(x, weight, bias)], activation, cu_seqlens)[0]
