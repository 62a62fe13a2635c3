"""flame's MoBA op (flame.models.layers.fla_moba, for FLA's MoBA layer without flash-attn) against MoBA's pattern
written out in float64 loops from FLA 0.6.0's parallel_moba: per query, its own block causally and the topk - 1
earlier full blocks of its document with the highest score (the query times the block's mean key), one softmax."""

import math

import pytest
import torch

from flame.models.layers.fla_moba import parallel_moba
from tests.models.layers.test_fla_attention import assert_output_and_gradients_close


def naive_moba(q, k, v, cu_seqlens, chunk_size, topk):
    q, k, v = (x[0].double() for x in (q, k, v))
    total, heads, dim = q.shape
    groups = heads // k.shape[1]
    bounds = cu_seqlens.tolist()
    not_last = sum(math.ceil((e - s) / chunk_size) - 1 for s, e in zip(bounds[:-1], bounds[1:]))
    chosen = min(topk - 1, not_last)
    out = torch.zeros_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        for t in range(start, end):
            own = (t - start) // chunk_size
            for h in range(heads):
                kv = h // groups
                if chosen <= 0:
                    keys = list(range(start, t + 1))
                else:
                    keys = list(range(start + own * chunk_size, t + 1))
                    scores = []
                    for b in range(own):  # earlier blocks of the document: full ones
                        block = range(start + b * chunk_size, start + (b + 1) * chunk_size)
                        mean = k[list(block), kv].mean(0)
                        scores.append((float(q[t, h] @ mean), b))
                    for _, b in sorted(scores, reverse=True)[:chosen]:
                        keys += list(range(start + b * chunk_size, start + (b + 1) * chunk_size))
                weights = torch.softmax(k[keys, kv] @ q[t, h] / math.sqrt(dim), 0)
                out[t, h] = weights @ v[keys, kv]
    return out[None]


@pytest.mark.parametrize(
    "lengths, chunk_size, topk, kv_heads",
    [([37, 20, 5], 4, 3, 3), ([64], 8, 2, 1), ([23, 41], 5, 9, 3), ([30], 4, 1, 3), ([3, 4], 4, 3, 3)],
)
def test_moba_equals_the_pattern_written_out(lengths, chunk_size, topk, kv_heads):
    """Odd document lengths (tail blocks), GQA, topk above the blocks there are, topk 1 and documents of one block
    (plain causal attention): outputs and gradients to 1e-6 in float32 against float64."""
    generator = torch.Generator().manual_seed(sum(lengths) + topk)
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(1, total, 3, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(1, total, kv_heads, 8, generator=generator, requires_grad=True) for _ in range(2))
    out = parallel_moba(q, k, v, cu_seqlens, max(lengths), chunk_size, topk)
    want = naive_moba(q, k, v, cu_seqlens, chunk_size, topk)
    assert_output_and_gradients_close(out, want, (q, k, v), generator, tolerance=1e-6)


def test_moba_refuses_rows_that_are_not_packed():
    q = torch.randn(2, 8, 2, 4)
    with pytest.raises(ValueError, match="batch size 1"):
        parallel_moba(q, q, q, torch.tensor([0, 8]), 8, 4, 2)
