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

Cost: a [heads, L, L] mask and SDPA over it for a document of L tokens, dense attention's time, where FLA's op on
flash-attn computes only the chosen blocks.
"""

import math

import torch
from torch.nn import functional as F


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
    fewer heads: query head h reads head h // (H // HKV)) -> [1, T, H, D]."""
    if q.shape[0] != 1:
        raise ValueError(
            f"MoBA takes documents packed in one row (batch size 1), got batch size {q.shape[0]}"
        )
    groups = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    blocks_not_last = sum(math.ceil(length / chunk_size) - 1 for length in lengths)
    chosen = min(topk - 1, blocks_not_last)
    outputs = [
        document_moba(q[0, start:end], k[0, start:end], v[0, start:end], chunk_size, chosen)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs)[None]


def document_moba(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int, chosen: int
) -> torch.Tensor:
    """One document, q/k/v [L, H, D]: its own block causally, and the ``chosen`` best earlier blocks (module
    docstring); plain causal attention where ``chosen`` <= 0."""
    length, heads, dim = q.shape
    position = torch.arange(length, device=q.device)
    block = position // chunk_size
    causal = position[None, :] <= position[:, None]  # [query, key]
    full_blocks = length // chunk_size
    if chosen <= 0:
        visible = causal.expand(heads, length, length)
    else:
        visible = (causal & (block[None, :] == block[:, None])).expand(heads, length, length)
        if (
            full_blocks > 0
        ):  # the earlier blocks a query may choose are full: only a document's last one is not
            means = k[: full_blocks * chunk_size].unflatten(0, (full_blocks, chunk_size)).mean(1).float()
            scores = torch.einsum("thd,bhd->htb", q.float(), means)  # [H, L, blocks]
            earlier = torch.arange(full_blocks, device=q.device)[None, :] < block[:, None]  # [L, blocks]
            scores = scores.masked_fill(~earlier, -math.inf)
            best = scores.topk(min(chosen, full_blocks), dim=-1).indices
            picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True) & earlier
            in_full_block = position < full_blocks * chunk_size
            keys_picked = picked[:, :, block.clamp(max=full_blocks - 1)] & in_full_block  # [H, L, L]
            visible = visible | keys_picked
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, scale=dim**-0.5
    )
    return out.transpose(0, 1)
