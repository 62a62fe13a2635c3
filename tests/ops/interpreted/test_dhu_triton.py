"""flame's Triton dh recurrence (run by Triton's interpreter on the CPU) against the PyTorch one in float64.

Inputs are float32 with odd lengths, partial chunks, grouped value heads, varlen, both state layouts, with and
without the gate, the final state's gradient and the initial state; small value blocks, so that several programs
share a head; dv given, or formed in the kernel (its intra-chunk part, FLA's chunk_bwd_dv_local). Limit: 1e-5
relative to the largest value of each result (float32 products in another order).
"""

import math

import pytest
import torch

from flame.ops.gated_delta_rule.dhu_reference import chunk_bwd_dhu_torch
from flame.ops.gated_delta_rule.dhu_triton import chunk_bwd_dhu_triton, fitting_configs, serves
from tests.ops.chunk_helpers import (
    INTERPRETED_ARGUMENTS,
    INTERPRETED_CASES,
    as_float64,
    assert_float32_close,
    chunk_local_decay,
    interpreted_layout,
    packed_chunk_indices,
    settings,
)

LAUNCH = {"BV": 16, "num_warps": 4, "num_stages": 1}
# Keys wider than 128 (a 256-wide tile), where the kernel accumulates the update's products into dh in place
WIDE_KEYS = ((21, 30), 1, 2, 136, 9, True, True, True)


@pytest.mark.parametrize("local_dv", [False, True], ids=["dv", "local-dv"])
@pytest.mark.parametrize(INTERPRETED_ARGUMENTS, [*INTERPRETED_CASES, WIDE_KEYS])
def test_matches_pytorch(
    lengths, num_heads, num_v_heads, key_dim, value_dim, state_v_first, gated, states, local_dv
):
    torch.manual_seed(0)
    chunk_size, scale = 16, 0.37
    batch, seq_len, cu_seqlens, sequences = interpreted_layout(lengths)
    q = torch.randn(batch, seq_len, num_heads, key_dim)
    k = torch.randn(batch, seq_len, num_heads, key_dim) / math.sqrt(key_dim)
    w = torch.randn(batch, seq_len, num_v_heads, key_dim) / math.sqrt(key_dim)
    do = torch.randn(batch, seq_len, num_v_heads, value_dim)
    dv = None if local_dv else torch.randn_like(do)
    g = None
    if gated:
        g = chunk_local_decay(batch, seq_len, num_v_heads, chunk_size, cu_seqlens, "cpu")
    state = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    h0 = torch.randn(sequences, num_v_heads, *state) if states else None
    dht = torch.randn(sequences, num_v_heads, *state) if states else None
    args = dict(g=g, h0=h0, dht=dht, scale=scale, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                chunk_size=chunk_size)  # fmt: skip

    expected = chunk_bwd_dhu_torch(*(x.double() for x in (q, k, w, do)), None if dv is None else dv.double(),
                                   **as_float64(args))  # fmt: skip
    result = chunk_bwd_dhu_triton(q, k, w, do, dv, **args, launch=LAUNCH)
    if cu_seqlens is not None:  # with FLA's chunk_indices, as its backward passes them: the same results
        chunk_indices = packed_chunk_indices(lengths, chunk_size)
        with_indices = chunk_bwd_dhu_triton(
            q, k, w, do, dv, **args, chunk_indices=chunk_indices, launch=LAUNCH
        )
        for got, want in zip(with_indices, result):
            assert (got is None and want is None) or torch.equal(got, want)
    assert_float32_close(("dh", "dh0", "dv2"), result, expected)


def test_refuses_keys_wider_than_its_tile():
    x = torch.zeros(1, 16, 1, 272)
    with pytest.raises(ValueError, match="K = 272 is over 256"):
        chunk_bwd_dhu_triton(x, x, x, torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8), launch=LAUNCH)


def test_tuning_leaves_out_settings_whose_tiles_do_not_fit():
    """The H100's 232,448 bytes of shared memory (Triton 3.6 compiled BV 64, 8 warps, 2 stages at K 256 in bf16 with
    value-first states in 217,604 bytes and refused 3 stages, asking 341,000; key-first states, which the bound
    leaves out at BV 64, compiled in 229,892 bytes for sm_90 with Triton 3.7.1); float32 inputs at K 256 fit no
    setting."""
    h100 = 232448
    assert settings(fitting_configs(256, 64, 2, True, h100)) == [(64, 8, 2), (32, 4, 2)]
    assert settings(fitting_configs(256, 64, 2, False, h100)) == [(32, 4, 2)]
    assert settings(fitting_configs(128, 64, 2, True, h100)) == [(64, 8, 2), (64, 8, 3), (32, 4, 2)]
    assert settings(fitting_configs(128, 64, 4, True, h100)) == [(32, 4, 2)]
    assert fitting_configs(256, 64, 4, True, h100) == []


def test_training_runs_it_only_on_cuda_bf16_inputs():
    assert not serves(torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16), 64, True)
    assert not serves(torch.zeros(1, 64, 1, 128, dtype=torch.float16), 64, True)
