"""flame's Triton chunk_bwd_dqkwg (run by Triton's interpreter on the CPU) against the PyTorch one.

The PyTorch function is itself checked against autograd in test_dqkwg_reference.py. Inputs are float32 with odd
lengths, partial chunks, grouped value heads, varlen and both state layouts; the kernel runs with small blocks so
that several key/value blocks and the partial-dg sum over key blocks are exercised. Limit: 1e-5 relative to the
largest value of each result (float32 products of length <= 64 in a different order).
"""

import math

import pytest
import torch
from fla.ops.utils.index import prepare_chunk_indices

from flame.ops.gated_delta_rule.dqkwg_reference import chunk_bwd_dqkwg_torch
from flame.ops.gated_delta_rule.dqkwg_triton import (
    chunk_bounds,
    chunk_bwd_dqkwg_triton,
    dot_precision,
)

# Small blocks: several key and value blocks per chunk (a chunk's key blocks adjacent in the launch), and the
# partial dg sums over key blocks.
LAUNCH = {"BK": 16, "BV": 16, "num_warps": 4, "num_stages": 1}
# A key block wider than half of K: the last block partly masked.
WIDE_KEYS = {"BK": 32, "BV": 16, "num_warps": 4, "num_stages": 1}


def test_chunk_bounds_follow_fla_chunk_order():
    starts, ends = chunk_bounds(2, 40, 16, None, torch.device("cpu"))
    assert starts.tolist() == [0, 16, 32, 40, 56, 72] and ends.tolist() == [16, 32, 40, 56, 72, 80]
    cu_seqlens = torch.tensor([0, 19, 40, 45])
    starts, ends = chunk_bounds(1, 45, 16, cu_seqlens, torch.device("cpu"))
    assert starts.tolist() == [0, 16, 19, 35, 40] and ends.tolist() == [16, 19, 35, 40, 45]
    fla_chunk_indices = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1], [2, 0]])
    with_indices = chunk_bounds(1, 45, 16, cu_seqlens, torch.device("cpu"), fla_chunk_indices)
    assert with_indices[0].tolist() == starts.tolist() and with_indices[1].tolist() == ends.tolist()


@pytest.mark.parametrize("launch", [LAUNCH, WIDE_KEYS], ids=["BK16", "BK32"])
@pytest.mark.parametrize(
    ("lengths", "num_heads", "num_v_heads", "key_dim", "value_dim", "state_v_first", "with_w", "fla_indices"),
    [
        ((37, 37), 2, 2, 20, 24, False, True, False),
        ((45,), 1, 3, 32, 17, True, True, False),
        ((19, 40, 5), 2, 4, 40, 33, True, False, False),
        ((19, 40, 5), 1, 2, 24, 20, False, True, True),
    ],
)
def test_matches_pytorch(
    lengths, num_heads, num_v_heads, key_dim, value_dim, state_v_first, with_w, fla_indices, launch
):
    """fla_indices: the chunk_indices passed as FLA's backward passes them (int32, beside int32 cu_seqlens)."""
    torch.manual_seed(0)
    chunk_size, scale = 16, 0.37
    varlen = len(lengths) != 2
    batch, seq_len = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if varlen else None
    starts, ends = chunk_bounds(batch, seq_len, chunk_size, cu_seqlens, torch.device("cpu"))
    q = torch.randn(batch, seq_len, num_heads, key_dim)
    k = torch.randn(batch, seq_len, num_heads, key_dim)
    v = torch.randn(batch, seq_len, num_v_heads, value_dim)
    w = torch.randn(batch, seq_len, num_v_heads, key_dim) if with_w else None
    raw = (-torch.rand(batch * seq_len, num_v_heads) / math.log(2)).view(batch, seq_len, num_v_heads)
    g = torch.zeros_like(raw).flatten(0, 1)
    for start, end in zip(starts.tolist(), ends.tolist()):  # token-local cumulative decay per chunk
        g[start:end] = raw.flatten(0, 1)[start:end].cumsum(0)
    g = g.view_as(raw)
    state = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    h = torch.randn(1, len(starts), num_v_heads, *state)
    dh = torch.randn_like(h)
    do = torch.randn_like(v)
    dv = torch.randn_like(v) if with_w else None
    args = dict(w=w, g=g, dv=dv, scale=scale, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                chunk_size=chunk_size)  # fmt: skip
    indices = {}
    if fla_indices:
        indices = dict(
            cu_seqlens=cu_seqlens.int(), chunk_indices=prepare_chunk_indices(cu_seqlens, chunk_size).int()
        )

    expected = chunk_bwd_dqkwg_torch(*(x.double() for x in (q, k, v, do, h, dh)),
                                     **{n: x.double() if torch.is_tensor(x) and x.is_floating_point() else x
                                        for n, x in args.items()})  # fmt: skip
    result = chunk_bwd_dqkwg_triton(q, k, v, do, h, dh, **{**args, **indices}, launch=launch)
    for name, got, want in zip(("dq", "dk", "dw", "dg"), result, expected):
        if want is None:
            assert got is None
            continue
        assert got.shape == want.shape and got.dtype == torch.float32, name
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-5, f"{name}: max error {err:.2e} of the largest value"


def test_refuses_the_ungated_case():
    x = torch.zeros(1, 16, 1, 16)
    with pytest.raises(ValueError, match="gated case only"):
        chunk_bwd_dqkwg_triton(
            x, x, x, x, torch.zeros(1, 1, 1, 16, 16), torch.zeros(1, 1, 1, 16, 16), launch=LAUNCH
        )


def test_float32_products_follow_tritons_default(monkeypatch):
    """As FLA's kernels that it stands in for: TF32 unless TRITON_F32_DEFAULT says otherwise (IEEE float32 products
    ran 49x slower on an H200, at Mamba-2's scan)."""
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert dot_precision() == "tf32"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert dot_precision() == "ieee"
