"""PyTorch code of FLA 0.6.0's rotary embedding (``fla.modules.rotary.ops.rotary_embedding``), with its arguments
and results, which FLA's ``RotaryEmbedding`` module calls for the queries and keys of its attention layers (MoBA,
NSA, Parallax, ...). Compiled blocks run this in place of FLA's Triton kernel
(flame.compat.fla_functions_traced_under_compile), where inductor fuses the rotation with the projections' epilogue
and the reshapes around it.

As FLA's kernel: the first ``2 * cos.shape[-1]`` channels of each head rotate (the two halves against each other,
or adjacent pairs when ``interleaved``) and the rest pass through; the arithmetic in float32 (float64 stays
float64); a position outside the cos/sin table (a negative offset under left padding) gives zeros in the rotated
channels. Positions restart at 0 in each document of ``cu_seqlens`` and are shifted by ``seqlen_offsets`` (one
number, or one per sequence)."""

import torch
from torch import Tensor


def rotary_embedding(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    chunk_indices: Tensor | None = None,  # FLA's kernel's launch grid: no meaning here
) -> Tensor:
    """x [B, T, H, D], cos/sin [TR, R] (R <= D / 2) -> x rotated, [B, T, H, D] in x's dtype."""
    tokens = x.shape[1]
    positions = torch.arange(tokens, device=x.device)
    if cu_seqlens is not None:  # x is [1, T, H, D]: documents packed along T
        document = torch.searchsorted(cu_seqlens, positions, right=True) - 1
        positions = positions - cu_seqlens[document]
        if isinstance(seqlen_offsets, Tensor):
            positions = positions + seqlen_offsets[document]
        positions = positions[None]
    elif isinstance(seqlen_offsets, Tensor):
        positions = positions[None] + seqlen_offsets[:, None]
    else:
        positions = positions[None]
    if not isinstance(seqlen_offsets, Tensor):
        positions = positions + seqlen_offsets
    inside = (positions >= 0) & (positions < cos.shape[0])
    positions = positions.clamp(0, cos.shape[0] - 1)

    compute = torch.promote_types(x.dtype, torch.float32)
    half = cos.shape[-1]
    cos, sin = (table[positions].to(compute)[:, :, None] for table in (cos, sin))  # [B or 1, T, 1, R]
    inside = inside[:, :, None, None]
    cos, sin = cos.masked_fill(~inside, 0), sin.masked_fill(~inside, 0)
    rotating = x[..., : 2 * half].to(compute)
    if interleaved:
        first, second = rotating[..., 0::2], rotating[..., 1::2]
        rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)
    else:
        first, second = rotating[..., :half], rotating[..., half:]
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    out = torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), dim=-1)
    if inplace:
        return x.copy_(out)
    return out
