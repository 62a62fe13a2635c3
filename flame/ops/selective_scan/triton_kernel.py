"""flame's Triton kernels for Mamba's selective scan (naive.py defines it), forward and backward.

    selective_scan_triton(u, delta, A, B, C, cu_seqlens=None) -> (y, last state)

Same contract as `selective_scan_recurrent`: u, delta [batch, T, D] (float16 / bfloat16 / float32 / float64),
A [D, N], B, C [batch, T, N]; y in u's dtype, the state in float32 (float64 for float64 inputs), without a gradient;
with ``cu_seqlens`` (documents packed into a row of batch 1) each document starts from a zero state and the states
are each document's last.

Why: without mamba_ssm's CUDA kernels (the package index has no wheels of them), FLA's Mamba layer runs a PyTorch
scan that materialises exp(delta A) and delta B u for every token, [batch, D, T, N] each, and keeps a state per token
for autograd: a 97M Mamba ran out of an H200's 140 GiB in its first step at 8 x 2048 tokens.

The recurrence h[t] = a[t] h[t-1] + x[t], with a[t] = exp(delta[t] A) and x[t] = delta[t] u[t] B[t] ([D, N] each),
is an associative scan of the pairs (a, x) under (a1, x1) then (a2, x2) = (a1 a2, a2 x1 + x2) (Blelloch; Mamba's
own kernels scan the same pairs). One program per (row, BLOCK_D channels) walks the tokens a chunk of CHUNK at a
time: it loads the chunk's inputs at once, scans the chunk's [CHUNK, BLOCK_D, N] pairs in parallel
(``tl.associative_scan``), applies them to the state entering the chunk, and writes y for the chunk's tokens and,
for the backward, the state entering the chunk.

The backward walks the chunks from the last. It recomputes the chunk's states from the stored one the same way,
then scans g[t] = dL/dh[t] = dy[t] C[t] + a[t+1] g[t+1] backwards over the chunk (pairs of the same form, read from
the chunk's last token, with the g entering from the next chunk), and from g and h:
    du[t] = delta[t] sum_n g B[t];  ddelta[t] = u[t] sum_n g B[t] + sum_n g a[t] h[t-1] A;  dA = sum_t g a[t] h[t-1] delta[t]
    dB[t] = sum_d g delta[t] u[t];  dC[t] = sum_d dy[t] h[t]
with a[t] h[t-1] = h[t] - x[t]. Packed documents set a[t] = 0 at each document's first token: its state is x[t]
alone, no gradient flows back past it, and a[t] h[t-1] = 0 leaves delta and A no term through the decay there. dB
and dC are summed over the channel blocks, dA over the rows, by torch after the
kernel (partial buffers, no atomics: deterministic). Sums run in float32 (float64 for float64 inputs). Forward and
backward are torch.library custom ops with shape-only fake implementations, so that a compiled Mamba block traces
them as single nodes instead of breaking its graph; eager calls run the same code as an autograd.Function
(flame.ops.custom_ops), which costs the host less than the op's dispatch. With TRITON_INTERPRET=1 set before this
module is imported, the kernels run in Triton's CPU interpreter (the CPU tests).
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from flame.ops.custom_ops import differentiable_op

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class ScanTiles:
    """How the kernels split the work: a program holds several [chunk, block_d, N] tiles."""

    chunk: int  # tokens scanned at once (the backward recomputes the forward's chunks: the same for both)
    block_d: int  # channels per program
    warps: int  # per program

    def __str__(self) -> str:
        return f"{self.chunk}x{self.block_d}x{self.warps}"

    @classmethod
    def parse(cls, text: str) -> "ScanTiles":
        """From "chunk x block_d x warps", as ``str`` writes it."""
        return cls(*(int(x) for x in text.split("x")))


# The fastest of the 17 splits timed on an H200 at Mamba's training shape (docs/performance.md, "Selective scan
# kernel": forward + backward 3.21 ms, 5.56 ms with 4 warps). The interpreter's chunks are short so that the CPU
# tests cross several.
TILES = ScanTiles(chunk=8, block_d=8, warps=1) if INTERPRETED else ScanTiles(chunk=16, block_d=8, warps=1)


@triton.jit
def _then(a1, x1, a2, x2):
    """The pair (a1, x1) followed by (a2, x2): h -> a2 (a1 h + x1) + x2."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _chunk_states(
    U, DELTA, B, KEEP, a, h, b, t, d, n, T, td_ok, tn_ok, stride_ub, stride_ut, stride_db, stride_dt, stride_bb,
    stride_bt, ACC: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
):  # fmt: skip
    """For the chunk's tokens t: delta, u and B, the pairs (exp(delta A), delta u B) and the states h[t] from h, the
    state entering the chunk. Past the last token delta = 0 and u = 0 (masked loads), so the pair (1, 0) leaves the
    state as it is. With packed documents KEEP [T] is 0 at a document's first token (its decay) and 1 elsewhere."""
    step = tl.load(DELTA + b * stride_db + t[:, None] * stride_dt + d[None, :], mask=td_ok, other=0.0).to(ACC)
    u = tl.load(U + b * stride_ub + t[:, None] * stride_ut + d[None, :], mask=td_ok, other=0.0).to(ACC)
    b_t = tl.load(B + b * stride_bb + t[:, None] * stride_bt + n[None, :], mask=tn_ok, other=0.0).to(ACC)
    decay = tl.exp(step[:, :, None] * a[None, :, :])
    if HAS_DOCUMENTS:
        decay = decay * tl.load(KEEP + t, mask=t < T, other=1.0).to(ACC)[:, None, None]
    x = (step * u)[:, :, None] * b_t[:, None, :]
    decays, inputs = tl.associative_scan((decay, x), 0, _then)
    return step, u, b_t, decay, x, decays * h[None, :, :] + inputs  # hs [CHUNK, BLOCK_D, BLOCK_N]


@triton.jit
def _fwd_kernel(
    U, DELTA, A, B, C, KEEP, ENDS, Y, STATES, LAST, T, D, N, NUM_CHUNKS,
    stride_ub, stride_ut, stride_db, stride_dt, stride_bb, stride_bt, stride_cb, stride_ct, stride_yb, stride_yt,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
):  # fmt: skip
    ACC: tl.constexpr = tl.float64 if U.dtype.element_ty == tl.float64 else tl.float32
    b = tl.program_id(1).to(tl.int64)
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, CHUNK)
    d_ok, n_ok = d < D, n < N
    tile_ok = d_ok[:, None] & n_ok[None, :]
    a = tl.load(A + d[:, None] * N + n[None, :], mask=tile_ok, other=0.0).to(ACC)
    h = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    # STATES [batch, NUM_CHUNKS, D, N]: the state entering each chunk
    states = STATES + (b * NUM_CHUNKS * D + d[:, None]) * N + n[None, :]
    for chunk in range(NUM_CHUNKS):
        tl.store(states + chunk * D * N, h, mask=tile_ok)
        t = chunk * CHUNK + rows
        td_ok = (t < T)[:, None] & d_ok[None, :]
        tn_ok = (t < T)[:, None] & n_ok[None, :]
        _, _, _, _, _, hs = _chunk_states(
            U, DELTA, B, KEEP, a, h, b, t, d, n, T, td_ok, tn_ok, stride_ub, stride_ut, stride_db, stride_dt,
            stride_bb, stride_bt, ACC, HAS_DOCUMENTS,
        )  # fmt: skip
        c_t = tl.load(C + b * stride_cb + t[:, None] * stride_ct + n[None, :], mask=tn_ok, other=0.0).to(ACC)
        y = tl.sum(hs * c_t[:, None, :], 2)
        tl.store(
            Y + b * stride_yb + t[:, None] * stride_yt + d[None, :], y.to(Y.dtype.element_ty), mask=td_ok
        )
        h = tl.sum(tl.where((rows == CHUNK - 1)[:, None, None], hs, 0.0), 0)
        # ENDS [T]: the document whose last token t is, or -1; its state is that document's last
        if HAS_DOCUMENTS:
            ends = tl.load(ENDS + t, mask=t < T, other=-1).to(tl.int64)
            tl.store(
                LAST + (ends[:, None, None] * D + d[None, :, None]) * N + n[None, None, :],
                hs,
                mask=(ends >= 0)[:, None, None] & tile_ok[None, :, :],
            )
    if not HAS_DOCUMENTS:
        tl.store(LAST + (b * D + d[:, None]) * N + n[None, :], h, mask=tile_ok)


@triton.jit
def _bwd_kernel(
    U, DELTA, A, B, C, KEEP, DY, STATES, DU, DDELTA, DA_PARTIAL, DB_PARTIAL, DC_PARTIAL, T, D, N, NUM_CHUNKS,
    stride_ub, stride_ut, stride_db, stride_dt, stride_bb, stride_bt, stride_cb, stride_ct, stride_dyb, stride_dyt,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
):  # fmt: skip
    ACC: tl.constexpr = tl.float64 if U.dtype.element_ty == tl.float64 else tl.float32
    b = tl.program_id(1).to(tl.int64)
    block = tl.program_id(0)
    d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, CHUNK)
    d_ok, n_ok = d < D, n < N
    tile_ok = d_ok[:, None] & n_ok[None, :]
    a = tl.load(A + d[:, None] * N + n[None, :], mask=tile_ok, other=0.0).to(ACC)
    states = STATES + (b * NUM_CHUNKS * D + d[:, None]) * N + n[None, :]
    # DB_PARTIAL, DC_PARTIAL [batch, D blocks, T, N]: this block's sums over its channels
    partial = (b * tl.num_programs(0) + block) * T * N
    # a[t] g[t] of the first token of the chunk after the current one: what reaches g[t] of the current chunk's last
    g_next = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    da = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    for i in range(NUM_CHUNKS):
        chunk = NUM_CHUNKS - 1 - i
        t = chunk * CHUNK + rows
        td_ok = (t < T)[:, None] & d_ok[None, :]
        tn_ok = (t < T)[:, None] & n_ok[None, :]
        entering = tl.load(states + chunk * D * N, mask=tile_ok, other=0.0)
        step, u, b_t, decay, x, hs = _chunk_states(
            U, DELTA, B, KEEP, a, entering, b, t, d, n, T, td_ok, tn_ok, stride_ub, stride_ut, stride_db, stride_dt,
            stride_bb, stride_bt, ACC, HAS_DOCUMENTS,
        )  # fmt: skip
        dy = tl.load(DY + b * stride_dyb + t[:, None] * stride_dyt + d[None, :], mask=td_ok, other=0.0).to(
            ACC
        )
        # g[t] = e[t] + a[t+1] g[t+1] with e[t] = dy[t] C[t], the chunk's last a[t+1] g[t+1] being g_next: a scan of
        # the pairs (a[t+1], e[t]) from the chunk's last token to its first, applied to g_next. Its tiles are read in
        # that order and scanned forwards (Triton's reversed scan of a non-commutative combine is wrong on GPUs:
        # triton-lang/triton#4362), and the result flipped back.
        t_back = chunk * CHUNK + CHUNK - 1 - rows
        back_ok = (t_back < T)[:, None] & d_ok[None, :]
        dy_back = tl.load(
            DY + b * stride_dyb + t_back[:, None] * stride_dyt + d[None, :], mask=back_ok, other=0.0
        )
        c_back = tl.load(C + b * stride_cb + t_back[:, None] * stride_ct + n[None, :],
                         mask=(t_back < T)[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        # a[t+1] = 1 for the chunk's last token (the first read) and past the last token
        next_ok = (rows > 0)[:, None] & (t_back + 1 < T)[:, None] & d_ok[None, :]
        step_next = tl.load(
            DELTA + b * stride_db + (t_back + 1)[:, None] * stride_dt + d[None, :], mask=next_ok, other=0.0
        ).to(ACC)
        e = dy_back.to(ACC)[:, :, None] * c_back.to(ACC)[:, None, :]
        decay_next = tl.exp(step_next[:, :, None] * a[None, :, :])
        if HAS_DOCUMENTS:  # no gradient reaches a document from the next one's first token
            keep_next = tl.load(KEEP + t_back + 1, mask=(rows > 0) & (t_back + 1 < T), other=1.0).to(ACC)
            decay_next = decay_next * keep_next[:, None, None]
        carries, sums = tl.associative_scan((decay_next, e), 0, _then)
        g = tl.flip(carries * g_next[None, :, :] + sums, 0)
        g_b = tl.sum(g * b_t[:, None, :], 2)
        through_decay = g * (hs - x)  # g[t] a[t] h[t-1]
        tl.store(DU + b * D * T + t[:, None] * D + d[None, :], step * g_b, mask=td_ok)
        ddelta = u * g_b + tl.sum(through_decay * a[None, :, :], 2)
        tl.store(DDELTA + b * D * T + t[:, None] * D + d[None, :], ddelta, mask=td_ok)
        da += tl.sum(through_decay * step[:, :, None], 0)
        db = tl.sum(g * (step * u)[:, :, None], 1)
        tl.store(DB_PARTIAL + partial + t[:, None] * N + n[None, :], db, mask=tn_ok)
        dc = tl.sum(dy[:, :, None] * hs, 1)
        tl.store(DC_PARTIAL + partial + t[:, None] * N + n[None, :], dc, mask=tn_ok)
        g_next = tl.sum(tl.where((rows == 0)[:, None, None], decay * g, 0.0), 0)
    tl.store(DA_PARTIAL + (b * D + d[:, None]) * N + n[None, :], da, mask=tile_ok)


def _row_major(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _compute_dtype(u: Tensor) -> torch.dtype:
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def _forward(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, keep: Tensor | None, ends: Tensor | None,
    documents: int, tiles: ScanTiles,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """y, the last state (each document's, with ``keep`` and ``ends``) and the states entering each chunk."""
    batch, length, dim = u.shape
    state_size = A.shape[1]
    chunks = triton.cdiv(length, tiles.chunk)
    y = torch.empty_like(u)
    states = u.new_empty(batch, chunks, dim, state_size, dtype=_compute_dtype(u))
    if keep is None:
        last = u.new_empty(batch, dim, state_size, dtype=_compute_dtype(u))
    else:  # an empty document's state stays zero
        last = u.new_zeros(documents, dim, state_size, dtype=_compute_dtype(u))
    _fwd_kernel[(triton.cdiv(dim, tiles.block_d), batch)](
        u, delta, A, B, C, u if keep is None else keep, u if ends is None else ends, y, states, last, length, dim,
        state_size, chunks, *u.stride()[:2], *delta.stride()[:2], *B.stride()[:2], *C.stride()[:2], *y.stride()[:2],
        CHUNK=tiles.chunk, BLOCK_D=tiles.block_d, BLOCK_N=triton.next_power_of_2(state_size),
        HAS_DOCUMENTS=keep is not None, num_warps=tiles.warps,
    )  # fmt: skip
    return y, last, states


def _backward(
    u, delta, A, B, C, keep, states, dy, tiles: ScanTiles
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    batch, length, dim = u.shape
    state_size = A.shape[1]
    blocks = triton.cdiv(dim, tiles.block_d)
    block_n = triton.next_power_of_2(state_size)
    compute = _compute_dtype(u)
    du = u.new_empty(batch, length, dim, dtype=compute)
    ddelta = torch.empty_like(du)
    da = u.new_empty(batch, dim, state_size, dtype=compute)
    db, dc = (u.new_empty(batch, blocks, length, state_size, dtype=compute) for _ in range(2))
    _bwd_kernel[(blocks, batch)](
        u, delta, A, B, C, u if keep is None else keep, dy, states, du, ddelta, da, db, dc, length, dim, state_size,
        states.shape[1], *u.stride()[:2], *delta.stride()[:2], *B.stride()[:2], *C.stride()[:2], *dy.stride()[:2],
        CHUNK=tiles.chunk, BLOCK_D=tiles.block_d, BLOCK_N=block_n, HAS_DOCUMENTS=keep is not None,
        num_warps=tiles.warps,
    )  # fmt: skip
    return (du.to(u.dtype), ddelta.to(delta.dtype), da.sum(0).to(A.dtype), db.sum(1).to(B.dtype),
            dc.sum(1).to(C.dtype))  # fmt: skip


def _forward_and_states(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, keep: Tensor | None, ends: Tensor | None,
    documents: int, chunk: int, block_d: int, warps: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """y, the last state and the states entering each chunk (saved for the backward); packed documents are marked
    by ``keep`` and ``ends`` (document_marks)."""
    u, delta, A, B, C = (_row_major(t) for t in (u, delta, A, B, C))
    return _forward(u, delta, A, B, C, keep, ends, documents, ScanTiles(chunk, block_d, warps))


selective_scan_fwd = torch.library.custom_op(
    "flame::selective_scan_fwd", _forward_and_states, mutates_args=()
)


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, keep, ends, documents, chunk, block_d, warps):
    batch, length, dim = u.shape
    compute = _compute_dtype(u)
    states = u.new_empty(batch, -(-length // chunk), dim, A.shape[1], dtype=compute)
    return (
        torch.empty_like(u, memory_format=torch.contiguous_format),
        u.new_empty(batch if keep is None else documents, dim, A.shape[1], dtype=compute),
        states,
    )


@torch.library.custom_op("flame::selective_scan_bwd", mutates_args=())
def selective_scan_bwd(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, keep: Tensor | None, states: Tensor, dy: Tensor,
    chunk: int, block_d: int, warps: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    u, delta, A, B, C = (_row_major(t) for t in (u, delta, A, B, C))
    return _backward(u, delta, A, B, C, keep, states, _row_major(dy), ScanTiles(chunk, block_d, warps))


@selective_scan_bwd.register_fake
def _(u, delta, A, B, C, keep, states, dy, chunk, block_d, warps):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (u, delta, A, B, C))


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, keep, _ends, _documents, chunk, block_d, warps = inputs
    ctx.save_for_backward(u, delta, A, B, C, keep, output[2])
    ctx.tiles = (chunk, block_d, warps)
    ctx.mark_non_differentiable(output[1], output[2])


def _gradients(ctx, dy, _last, _states):
    u, delta, A, B, C, keep, states = ctx.saved_tensors
    return *selective_scan_bwd(u, delta, A, B, C, keep, states, dy, *ctx.tiles), *(None,) * 6


# Eager calls run the kernels through an autograd.Function, compiled graphs through the ops.
_selective_scan = differentiable_op(selective_scan_fwd, _forward_and_states, _setup_context, _gradients)


def document_marks(cu_seqlens: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The kernels' view of packed documents: ``keep`` [length] in the scan's dtype, 0 at each document's first token
    and 1 elsewhere (the decay that carries a state in), and ``ends`` [length] int32, the index of the document
    whose last token each token is, or -1 (an empty document ends nowhere: where it meets the one before, that one
    is kept). Shapes depend on ``length`` alone, so a compiled block does not break on the boundaries' values."""
    bounds = cu_seqlens.long()
    keep = torch.ones(
        length + 1, dtype=dtype, device=bounds.device
    )  # + 1: starts of empty documents at the end
    keep[bounds[:-1]] = 0
    documents = torch.arange(len(bounds) - 1, dtype=torch.int32, device=bounds.device)
    # Position e + 1 holds the document ending at token e; the first position, empty documents at the start.
    ends = torch.full((length + 1,), -1, dtype=torch.int32, device=bounds.device)
    ends.scatter_reduce_(0, bounds[1:], documents, reduce="amin", include_self=False)
    return keep[:length], ends[1:]


def selective_scan_triton(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, cu_seqlens: Tensor | None = None,
    tiles: ScanTiles = TILES,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Arguments and results of `selective_scan_recurrent` (naive.py); ``tiles`` for the bench's comparisons."""
    keep = ends = None
    if cu_seqlens is not None:
        keep, ends = document_marks(cu_seqlens.to(u.device), u.shape[1], _compute_dtype(u))
    documents = 0 if cu_seqlens is None else len(cu_seqlens) - 1
    y, last, _ = _selective_scan(
        u, delta, A, B, C, keep, ends, documents, tiles.chunk, tiles.block_d, tiles.warps
    )
    return y, last
