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
    [
        ([37, 20, 5], 4, 3, 3),
        ([64], 8, 2, 1),
        ([23, 41], 5, 9, 3),
        ([30], 4, 1, 3),
        ([3, 4], 4, 3, 3),
        ([24, 24, 24], 5, 3, 1),
        ([32, 32], 8, 3, 3),
    ],
)
@pytest.mark.parametrize("longest", ["given", "above"])
def test_moba_equals_the_pattern_written_out(lengths, chunk_size, topk, kv_heads, longest):
    """Odd document lengths (tail blocks), GQA, topk above the blocks there are, topk 1, documents of one block
    (plain causal attention) and rows of one length (one call for all of them where max_seqlen says so; per
    document where it is only a bound above): outputs and gradients to 1e-6 in float32 against float64."""
    generator = torch.Generator().manual_seed(sum(lengths) + topk)
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(1, total, 3, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(1, total, kv_heads, 8, generator=generator, requires_grad=True) for _ in range(2))
    max_seqlen = max(lengths) + (0 if longest == "given" else 5)
    out = parallel_moba(q, k, v, cu_seqlens, max_seqlen, chunk_size, topk)
    want = naive_moba(q, k, v, cu_seqlens, chunk_size, topk)
    assert_output_and_gradients_close(out, want, (q, k, v), generator, tolerance=1e-6)


def test_moba_refuses_rows_that_are_not_packed():
    q = torch.randn(2, 8, 2, 4)
    with pytest.raises(ValueError, match="batch size 1"):
        parallel_moba(q, q, q, torch.tensor([0, 8]), 8, 4, 2)


def test_rows_of_one_length_are_attended_without_reading_cu_seqlens():
    """Where max_seqlen times the documents is the row's length, the op reads only cu_seqlens' shape (cu_seqlens on
    the meta device has no values to read), so a CUDA graph can capture it; the output equals the pattern's."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 48, 2, 8, generator=generator) for _ in range(3))
    out = parallel_moba(q, k, v, torch.empty(3, dtype=torch.int32, device="meta"), 24, 4, 3)
    want = naive_moba(q, k, v, torch.tensor([0, 24, 48]), 4, 3)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "documents, length, chunk_size, topk",
    [(2, 512, 128, 3), (1, 384, 256, 4)],
)
def test_flex_attention_block_mask_equals_the_pattern(documents, length, chunk_size, topk):
    """The FlexAttention path (compiled blocks on a GPU) attends by ``moba_block_mask``: here compiled on the CPU,
    forward only (FlexAttention has no CPU backward), with the choices made outside the compiled function (the CPU
    template takes no mask input computed inside it): outputs within 1e-5 of the pattern in float64 (the kernel's
    float32 online softmax). The GPU test compares the whole path, gradients included."""
    from torch.nn.attention.flex_attention import flex_attention

    from flame.models.layers.fla_moba import chosen_blocks, moba_block_mask

    generator = torch.Generator().manual_seed(length + topk)
    q, k, v = (torch.randn(1, documents * length, 3, 16, generator=generator) for _ in range(3))
    rows = [x[0].unflatten(0, (documents, length)).transpose(1, 2) for x in (q, k, v)]
    picked = chosen_blocks(*rows[:2], chunk_size, topk - 1)

    def attend(q, k, v, picked):
        return flex_attention(q, k, v, block_mask=moba_block_mask(picked, chunk_size, length), scale=0.25)

    out = (
        torch.compile(attend, fullgraph=True, dynamic=False)(*rows, picked)
        .transpose(1, 2)
        .flatten(0, 1)[None]
    )
    cu_seqlens = torch.arange(documents + 1) * length
    want = naive_moba(q, k, v, cu_seqlens, chunk_size, topk)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
