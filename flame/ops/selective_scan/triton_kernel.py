"""flame's Triton kernels for Mamba's selective scan (naive.py defines it), forward and backward.

    selective_scan_triton(u, delta, A, B, C) -> (y, last state)

Same contract as `selective_scan_recurrent`: u, delta [batch, T, D] (float16 / bfloat16 / float32 / float64),
A [D, N], B, C [batch, T, N]; y in u's dtype, the state in float32 (float64 for float64 inputs), without a gradient.

Why: without mamba_ssm's CUDA kernels (the package index has no wheels of them), FLA's Mamba layer runs a PyTorch
scan that materialises exp(delta A) and delta B u for every token, [batch, D, T, N] each, and keeps a state per token
for autograd: a 97M Mamba ran out of an H200's 140 GiB in its first step at 8 x 2048 tokens.

- The forward runs one program per (row, BLOCK_D channels); it walks the tokens in order with the [BLOCK_D, N]
  state in registers, writes y and, every CHUNK tokens, the state entering the chunk (for the backward).
- The backward walks the chunks from the last: it recomputes the chunk's states from the stored one into a scratch
  buffer of its own, then walks the chunk's tokens backwards with g = dL/dh[t] in registers:
      g += dy[t] C[t];  du[t] = delta[t] sum_n g B[t];  ddelta[t] = u[t] sum_n g B[t] + sum_n g h[t-1] a[t] A
      dA += g h[t-1] a[t] delta[t];  dB[t] += sum_d g delta[t] u[t];  dC[t] += sum_d dy[t] h[t];  g *= a[t]
  with a[t] = exp(delta[t] A). dB and dC are summed over the channel blocks, dA over the rows, by torch after the
  kernel (partial buffers, no atomics: deterministic).
Sums run in float32 (float64 for float64 inputs). The kernels are autograd through torch.autograd.Function: FLA's
Mamba blocks run eagerly (and replay as CUDA graphs on one GPU), so torch.compile does not trace them. With
TRITON_INTERPRET=1 set before this module is imported, the kernels run in Triton's CPU interpreter (the CPU tests).
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Tokens between the states the forward stores: the backward recomputes at most CHUNK states per channel block.
CHUNK = 8 if INTERPRETED else 64
BLOCK_D = 8 if INTERPRETED else 32


@triton.jit
def _fwd_kernel(
    U, DELTA, A, B, C, Y, STATES, LAST, T, D, N, NUM_CHUNKS,
    stride_ub, stride_ut, stride_db, stride_dt, stride_bb, stride_bt, stride_cb, stride_ct, stride_yb, stride_yt,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    ACC: tl.constexpr = tl.float64 if U.dtype.element_ty == tl.float64 else tl.float32
    b = tl.program_id(1).to(tl.int64)
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < D, n < N
    tile_ok = d_ok[:, None] & n_ok[None, :]
    a = tl.load(A + d[:, None] * N + n[None, :], mask=tile_ok, other=0.0).to(ACC)
    h = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    # STATES [batch, NUM_CHUNKS, D, N]: the state entering each chunk
    states = STATES + (b * NUM_CHUNKS * D + d[:, None]) * N + n[None, :]
    for t in range(T):
        if t % CHUNK == 0:
            tl.store(states + (t // CHUNK) * D * N, h, mask=tile_ok)
        step = tl.load(DELTA + b * stride_db + t * stride_dt + d, mask=d_ok, other=0.0).to(ACC)
        u = tl.load(U + b * stride_ub + t * stride_ut + d, mask=d_ok, other=0.0).to(ACC)
        b_t = tl.load(B + b * stride_bb + t * stride_bt + n, mask=n_ok, other=0.0).to(ACC)
        c_t = tl.load(C + b * stride_cb + t * stride_ct + n, mask=n_ok, other=0.0).to(ACC)
        h = tl.exp(step[:, None] * a) * h + (step * u)[:, None] * b_t[None, :]
        y = tl.sum(h * c_t[None, :], 1)
        tl.store(Y + b * stride_yb + t * stride_yt + d, y.to(Y.dtype.element_ty), mask=d_ok)
    tl.store(LAST + (b * D + d[:, None]) * N + n[None, :], h, mask=tile_ok)


@triton.jit
def _bwd_kernel(
    U, DELTA, A, B, C, DY, STATES, SCRATCH, DU, DDELTA, DA_PARTIAL, DB_PARTIAL, DC_PARTIAL, T, D, N, NUM_CHUNKS,
    stride_ub, stride_ut, stride_db, stride_dt, stride_bb, stride_bt, stride_cb, stride_ct, stride_dyb, stride_dyt,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    ACC: tl.constexpr = tl.float64 if U.dtype.element_ty == tl.float64 else tl.float32
    b = tl.program_id(1).to(tl.int64)
    block = tl.program_id(0)
    d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < D, n < N
    tile_ok = d_ok[:, None] & n_ok[None, :]
    tile = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + n[None, :]
    a = tl.load(A + d[:, None] * N + n[None, :], mask=tile_ok, other=0.0).to(ACC)
    states = STATES + (b * NUM_CHUNKS * D + d[:, None]) * N + n[None, :]
    # SCRATCH [batch, D blocks, CHUNK, BLOCK_D, BLOCK_N]: this program's states h[t] of the current chunk
    scratch = SCRATCH + ((b * tl.num_programs(0) + block) * CHUNK) * BLOCK_D * BLOCK_N + tile
    # DB_PARTIAL, DC_PARTIAL [batch, D blocks, T, N]: this block's sums over its channels
    partial = (b * tl.num_programs(0) + block) * T * N
    g = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    da = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    for i in range(NUM_CHUNKS):
        chunk = NUM_CHUNKS - 1 - i
        start = chunk * CHUNK
        length = tl.minimum(T - start, CHUNK)
        entering = tl.load(states + chunk * D * N, mask=tile_ok, other=0.0)
        h = entering
        for k in range(length):
            t = start + k
            step = tl.load(DELTA + b * stride_db + t * stride_dt + d, mask=d_ok, other=0.0).to(ACC)
            u = tl.load(U + b * stride_ub + t * stride_ut + d, mask=d_ok, other=0.0).to(ACC)
            b_t = tl.load(B + b * stride_bb + t * stride_bt + n, mask=n_ok, other=0.0).to(ACC)
            h = tl.exp(step[:, None] * a) * h + (step * u)[:, None] * b_t[None, :]
            tl.store(scratch + k * BLOCK_D * BLOCK_N, h)
        for j in range(length):
            k = length - 1 - j
            t = start + k
            step = tl.load(DELTA + b * stride_db + t * stride_dt + d, mask=d_ok, other=0.0).to(ACC)
            u = tl.load(U + b * stride_ub + t * stride_ut + d, mask=d_ok, other=0.0).to(ACC)
            b_t = tl.load(B + b * stride_bb + t * stride_bt + n, mask=n_ok, other=0.0).to(ACC)
            c_t = tl.load(C + b * stride_cb + t * stride_ct + n, mask=n_ok, other=0.0).to(ACC)
            dy = tl.load(DY + b * stride_dyb + t * stride_dyt + d, mask=d_ok, other=0.0).to(ACC)
            h = tl.load(scratch + k * BLOCK_D * BLOCK_N)
            before = tl.load(scratch + (k - 1) * BLOCK_D * BLOCK_N, mask=(k > 0) & tile_ok, other=0.0)
            before = tl.where(k > 0, before, entering)
            decay = tl.exp(step[:, None] * a)
            g += dy[:, None] * c_t[None, :]
            g_b = tl.sum(g * b_t[None, :], 1)
            through_decay = g * before * decay
            tl.store(DU + b * D * T + t * D + d, step * g_b, mask=d_ok)
            tl.store(DDELTA + b * D * T + t * D + d, u * g_b + tl.sum(through_decay * a, 1), mask=d_ok)
            da += through_decay * step[:, None]
            tl.store(DB_PARTIAL + partial + t * N + n, tl.sum(g * (step * u)[:, None], 0), mask=n_ok)
            tl.store(DC_PARTIAL + partial + t * N + n, tl.sum(dy[:, None] * h, 0), mask=n_ok)
            g *= decay
    tl.store(DA_PARTIAL + (b * D + d[:, None]) * N + n[None, :], da, mask=tile_ok)


def _row_major(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _compute_dtype(u: Tensor) -> torch.dtype:
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def _forward(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """y, the last state and the states entering each chunk."""
    batch, length, dim = u.shape
    state_size = A.shape[1]
    chunks = triton.cdiv(length, CHUNK)
    y = torch.empty_like(u)
    states = u.new_empty(batch, chunks, dim, state_size, dtype=_compute_dtype(u))
    last = u.new_empty(batch, dim, state_size, dtype=_compute_dtype(u))
    _fwd_kernel[(triton.cdiv(dim, BLOCK_D), batch)](
        u, delta, A, B, C, y, states, last, length, dim, state_size, chunks,
        *u.stride()[:2], *delta.stride()[:2], *B.stride()[:2], *C.stride()[:2], *y.stride()[:2],
        CHUNK=CHUNK, BLOCK_D=BLOCK_D, BLOCK_N=triton.next_power_of_2(state_size),
    )  # fmt: skip
    return y, last, states


def _backward(u, delta, A, B, C, states, dy) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    batch, length, dim = u.shape
    state_size = A.shape[1]
    blocks = triton.cdiv(dim, BLOCK_D)
    block_n = triton.next_power_of_2(state_size)
    compute = _compute_dtype(u)
    scratch = u.new_empty(batch, blocks, CHUNK, BLOCK_D, block_n, dtype=compute)
    du = u.new_empty(batch, length, dim, dtype=compute)
    ddelta = torch.empty_like(du)
    da = u.new_empty(batch, dim, state_size, dtype=compute)
    db, dc = (u.new_empty(batch, blocks, length, state_size, dtype=compute) for _ in range(2))
    _bwd_kernel[(blocks, batch)](
        u, delta, A, B, C, dy, states, scratch, du, ddelta, da, db, dc, length, dim, state_size, states.shape[1],
        *u.stride()[:2], *delta.stride()[:2], *B.stride()[:2], *C.stride()[:2], *dy.stride()[:2],
        CHUNK=CHUNK, BLOCK_D=BLOCK_D, BLOCK_N=block_n,
    )  # fmt: skip
    return (du.to(u.dtype), ddelta.to(delta.dtype), da.sum(0).to(A.dtype), db.sum(1).to(B.dtype),
            dc.sum(1).to(C.dtype))  # fmt: skip


class SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C):
        u, delta, A, B, C = (_row_major(t) for t in (u, delta, A, B, C))
        y, last, states = _forward(u, delta, A, B, C)
        ctx.save_for_backward(u, delta, A, B, C, states)
        ctx.mark_non_differentiable(last)
        return y, last

    @staticmethod
    def backward(ctx, dy, _):
        u, delta, A, B, C, states = ctx.saved_tensors
        return _backward(u, delta, A, B, C, states, _row_major(dy))


def selective_scan_triton(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor]:
    """Arguments and results of `selective_scan_recurrent` (naive.py)."""
    return SelectiveScan.apply(u, delta, A, B, C)
