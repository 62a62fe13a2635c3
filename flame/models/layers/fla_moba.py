"""FLA 0.6.0's MoBA op (``fla.ops.moba.parallel_moba``; MoBA: Lu et al., "MoBA: Mixture of Block Attention for
Long-Context LLMs", arXiv 2502.13189) for machines without flash-attn, which FLA's op runs only on: the same
attention pattern as one masked softmax attention per document (flame.compat.fla_moba_on_flame points FLA's MoBA
layer at :func:`parallel_moba` there).

The pattern, as FLA's op computes it: each document is cut into blocks of ``chunk_size`` tokens (its last block
may be shorter). A query attends causally within its own block, and to every key of the ``topk - 1`` earlier blocks
of its document that score highest against it: the query times the mean of the block's keys (the mean in the keys'
dtype, the product in float32). One softmax over those keys, scale 1/sqrt(head_dim). Where ``topk - 1``, capped by
the number of blocks in the batch that are not their document's last, is 0 or less, attention is plain causal over
each document (FLA's short cut). The block choice has no gradient.

Cost, eager: an additive [heads, L, L] mask and one SDPA call over it (its fused kernels, which take a mask on the
GPU, in the inputs' dtype) for all documents of one length, dense attention's time, where FLA's op on flash-attn
computes only the chosen blocks. Compiled on a GPU, where the blocks are whole multiples of FlexAttention's
128-token tiles: one FlexAttention call whose block mask lists, per query tile, the tiles of its own block up to
it and the tiles of the blocks any of its queries chose (the mask itself read per element from the [L, blocks]
choices), so the work is that of the chosen blocks and no [L, L] tensor is made.
"""

import math

import torch
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# FlexAttention's tile (query and key tokens per block of its mask).
FLEX_TILE = 128


def parallel_moba(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    chunk_size: int,
    topk: int,
) -> torch.Tensor:
    """FLA's ``parallel_moba`` arguments: q/k/v [1, T, H, D] with documents packed at ``cu_seqlens`` (k/v may have
    fewer heads: query head h reads head h // (H // HKV)) and no document longer than ``max_seqlen`` ->
    [1, T, H, D]."""
    if q.shape[0] != 1:
        raise ValueError(
            f"MoBA takes documents packed in one row (batch size 1), got batch size {q.shape[0]}"
        )
    groups = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    documents = cu_seqlens.shape[0] - 1
    if documents * max_seqlen == q.shape[1]:
        # None is longer than max_seqlen and together they are T long: each is max_seqlen long (FLA's layer packs
        # a [B, T] batch so). Known without reading cu_seqlens, so a CUDA graph can capture the call; one call
        # attends all of them.
        chosen = min(topk - 1, documents * (math.ceil(max_seqlen / chunk_size) - 1))
        rows = (x[0].view(documents, max_seqlen, *x.shape[2:]) for x in (q, k, v))
        return moba_rows(*rows, chunk_size, chosen).flatten(0, 1)[None]
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    chosen = min(topk - 1, sum(math.ceil(length / chunk_size) - 1 for length in lengths))
    outputs = [
        moba_rows(q[:, start:end], k[:, start:end], v[:, start:end], chunk_size, chosen)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=1)


def moba_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int, chosen: int
) -> torch.Tensor:
    """Documents of one length, q/k/v [N, L, H, D]: each query its own block causally, and the ``chosen`` best
    earlier blocks (module docstring); plain causal attention where ``chosen`` <= 0."""
    rows, length, heads, dim = q.shape
    # The earlier blocks a query may choose are full: only the last one is not.
    full_blocks = length // chunk_size
    # [N, H, L, D]: SDPA's fused kernels take 4-D inputs only.
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if chosen <= 0 or full_blocks == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dim**-0.5)
        return out.transpose(1, 2)
    picked = chosen_blocks(q, k, chunk_size, chosen)
    if flex_serves(q, chunk_size, length):
        mask = moba_block_mask(picked, chunk_size, length)
        return flex_attention(q, k, v, block_mask=mask, scale=dim**-0.5).transpose(1, 2)
    # SDPA's additive mask in the inputs' dtype, built in few passes over its [N, H, L, L] elements (a boolean mask
    # would be converted to it): the picked blocks' keys per query, then each query's own block causally.
    blocks = math.ceil(length / chunk_size)
    block_bias = q.new_full((rows, heads, length, blocks), -math.inf)
    block_bias[..., :full_blocks].masked_fill_(picked, 0)
    # Each block's column repeated over its keys as a broadcast copy: a gather along the last dim was the largest
    # kernel after attention in an H200 profile.
    bias = block_bias[..., None].expand(*block_bias.shape, chunk_size).flatten(-2)[..., :length]
    if length % chunk_size == 0:  # the own blocks are the diagonal ones: only they are written
        diagonal = bias.view(rows, heads, blocks, chunk_size, blocks, chunk_size).diagonal(dim1=2, dim2=4)
        in_block = torch.arange(chunk_size, device=q.device)
        diagonal.masked_fill_((in_block[None, :] <= in_block[:, None])[..., None], 0)  # [query, key, block]
    else:
        position = torch.arange(length, device=q.device)
        block = position // chunk_size
        own_block = (position[None, :] <= position[:, None]) & (block[None, :] == block[:, None])
        bias.masked_fill_(own_block, 0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=dim**-0.5)
    return out.transpose(1, 2)


def chosen_blocks(q: torch.Tensor, k: torch.Tensor, chunk_size: int, chosen: int) -> torch.Tensor:
    """q/k [N, H, L, D] -> [N, H, L, full blocks]: the ``chosen`` earlier full blocks of each query with the highest
    score (at most as many as there are before it)."""
    length = q.shape[2]
    full_blocks = length // chunk_size
    block = torch.arange(length, device=q.device) // chunk_size
    rows, heads, _, dim = k.shape
    means = (
        k[:, :, : full_blocks * chunk_size].reshape(rows, heads, full_blocks, chunk_size, dim).mean(3).float()
    )
    scores = q.float() @ means.transpose(-1, -2)
    earlier = torch.arange(full_blocks, device=q.device)[None, :] < block[:, None]  # [L, full blocks]
    scores = scores.masked_fill(~earlier, -math.inf)
    best = scores.topk(min(chosen, full_blocks), dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True) & earlier


def flex_serves(q: torch.Tensor, chunk_size: int, length: int) -> bool:
    """FlexAttention runs compiled (eager, it computes the dense scores) and trains on CUDA only; its mask's tiles
    must not straddle two blocks."""
    return (
        torch.compiler.is_compiling()
        and q.is_cuda
        and chunk_size % FLEX_TILE == 0
        and length % FLEX_TILE == 0
    )


def moba_block_mask(picked: torch.Tensor, chunk_size: int, length: int) -> BlockMask:
    """The MoBA pattern as a FlexAttention block mask for documents of ``length`` tokens, from ``picked`` [N, H, L,
    full blocks] (the earlier blocks each query chose). Per query tile: the tiles of its own block before it, which
    it sees whole ("full" tiles, no mask read), its diagonal tile, and the tiles of every block one of its queries
    chose (tiles where the mask is read per element). ``chunk_size`` and ``length`` are multiples of FLEX_TILE."""
    rows, heads, _, full_blocks = picked.shape
    blocks = math.ceil(length / chunk_size)
    # The last block is never chosen (it is no query's earlier block) but a key of it indexes a column.
    picked = torch.cat((picked, picked.new_zeros(rows, heads, length, blocks - full_blocks)), dim=-1)
    tiles = length // FLEX_TILE
    tile = torch.arange(tiles, device=picked.device)
    tile_block = tile * FLEX_TILE // chunk_size
    own_earlier = (tile_block[:, None] == tile_block[None, :]) & (tile[None, :] < tile[:, None])
    chosen = picked.view(rows, heads, tiles, FLEX_TILE, blocks).any(3)  # [N, H, query tile, block]
    partial = chosen[..., tile_block] | torch.eye(tiles, dtype=torch.bool, device=picked.device)

    def listed(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query tile: how many key tiles, and their indices first (FlexAttention's kv_num_blocks, kv_indices)."""
        dense = dense.expand(rows, heads, tiles, tiles)
        order = dense.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
        return dense.sum(-1, dtype=torch.int32), order.to(torch.int32)

    def mask_mod(row, head, query, key):
        key_block = key // chunk_size
        own = (query // chunk_size == key_block) & (key <= query)
        return own | picked[row, head, query, key_block]

    return BlockMask.from_kv_blocks(
        *listed(partial),
        *listed(own_earlier),
        BLOCK_SIZE=FLEX_TILE,
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )
