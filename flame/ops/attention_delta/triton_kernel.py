"""flame's Triton kernel for the attention backward's delta (reference.py defines it).

    attention_delta_triton(o, do) -> delta

One program reads BLOCK_ROWS rows of o and do (each V wide, padded to a power of 2) and writes their BLOCK_ROWS dot
products, each summed in float32 (float64 for float64 inputs): the kernel reads the two tensors once, in tiles large
enough that the GPU's bandwidth rather than its program launches sets the time. With TRITON_INTERPRET=1 set before
this module is imported, the kernel runs in Triton's CPU interpreter (the CPU tests).
"""

import torch
import triton
import triton.language as tl

from flame.ops.attention_delta.reference import sum_dtype

# ~16 KiB of each input per program at V = 64 in bf16; fewer rows as V grows, so a tile stays in registers.
ROW_ELEMENTS = 8192


@triton.jit
def attention_delta_kernel(
    o, do, delta, rows, V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_ROWS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    column = tl.arange(0, BLOCK_V)
    mask = (row[:, None] < rows) & (column[None, :] < V)
    offsets = row[:, None] * V + column[None, :]
    sum_type = delta.dtype.element_ty
    b_o = tl.load(o + offsets, mask=mask, other=0).to(sum_type)
    b_do = tl.load(do + offsets, mask=mask, other=0).to(sum_type)
    tl.store(delta + row, tl.sum(b_o * b_do, axis=1), mask=row < rows)


def attention_delta_triton(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """o, do [..., V] on one CUDA device (any float dtypes) -> delta [...] in float32 (float64 for float64 o)."""
    if o.shape != do.shape:
        raise ValueError(f"o and do differ in shape: {tuple(o.shape)} and {tuple(do.shape)}")
    width = o.shape[-1]
    o, do = o.contiguous(), do.contiguous()
    delta = torch.empty(o.shape[:-1], dtype=sum_dtype(o.dtype), device=o.device)
    rows = delta.numel()
    if rows == 0:
        return delta
    block_v = triton.next_power_of_2(width)
    block_rows = max(1, min(triton.next_power_of_2(rows), ROW_ELEMENTS // block_v))
    attention_delta_kernel[(triton.cdiv(rows, block_rows),)](
        o, do, delta, rows, V=width, BLOCK_V=block_v, BLOCK_ROWS=block_rows, num_warps=4
    )
    return delta
