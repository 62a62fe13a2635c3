"""flame's PyTorch reference of FLA's chunk_bwd_dv_local (dhu_reference.py, what flame's dh recurrence forms in its
kernel when called without dv) against autograd of the output it differentiates: the intra-chunk part of the
chunked output (fwd_o_reference.py with zero chunk states), in float64 with odd lengths, partial chunks, grouped
value heads, packed documents, gated and plain."""

import pytest
import torch

from flame.ops.gated_delta_rule.dhu_reference import chunk_bwd_dv_local_torch
from flame.ops.gated_delta_rule.fwd_o_reference import chunk_fwd_o_torch
from tests.ops.chunk_helpers import chunk_local_decay, interpreted_layout


@pytest.mark.parametrize(
    ("lengths", "num_heads", "num_v_heads", "gated"),
    [((37, 37), 2, 2, True), ((19, 40, 5), 1, 3, True), ((29, 29), 2, 4, False)],
)
def test_dv_local_is_the_gradient_of_the_intra_chunk_output(lengths, num_heads, num_v_heads, gated):
    torch.manual_seed(0)
    chunk_size, scale, key_dim, value_dim = 16, 0.37, 12, 9
    batch, seq_len, cu_seqlens, _ = interpreted_layout(lengths)
    q = torch.randn(batch, seq_len, num_heads, key_dim, dtype=torch.float64)
    k = torch.randn(batch, seq_len, num_heads, key_dim, dtype=torch.float64)
    v = torch.randn(batch, seq_len, num_v_heads, value_dim, dtype=torch.float64, requires_grad=True)
    do = torch.randn(batch, seq_len, num_v_heads, value_dim, dtype=torch.float64)
    g = None
    if gated:
        g = chunk_local_decay(batch, seq_len, num_v_heads, chunk_size, cu_seqlens, "cpu").double()
    chunks = sum(-(-length // chunk_size) for length in lengths) if cu_seqlens is not None else None
    rows = (1, chunks) if cu_seqlens is not None else (batch, -(-seq_len // chunk_size))
    h = torch.zeros(*rows, num_v_heads, key_dim, value_dim, dtype=torch.float64)
    o = chunk_fwd_o_torch(q, k, v, h, g, scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    (expected,) = torch.autograd.grad((o * do).sum(), v)

    dv = chunk_bwd_dv_local_torch(q, k, do, g, scale, cu_seqlens, chunk_size)
    torch.testing.assert_close(dv, expected, rtol=1e-12, atol=1e-12)
