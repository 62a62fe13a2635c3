"""flame's Triton state recurrence (run by Triton's interpreter on the CPU) against the PyTorch one in float64.

Inputs are float32 with odd lengths, partial chunks, grouped value heads, varlen, both state layouts, with and
without the gate, the initial state and the final state; small value blocks, so that several programs share a
head. Limit: 1e-5 relative to the largest value of each result (float32 products in another order).
"""

import math

import pytest
import torch

from flame.ops.gated_delta_rule.fwd_h_reference import chunk_fwd_h_torch
from flame.ops.gated_delta_rule.fwd_h_triton import chunk_fwd_h_triton, fitting_configs, serves
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


@pytest.mark.parametrize(INTERPRETED_ARGUMENTS, INTERPRETED_CASES)
def test_matches_pytorch(lengths, num_heads, num_v_heads, key_dim, value_dim, state_v_first, gated, states):
    torch.manual_seed(0)
    chunk_size = 16
    batch, seq_len, cu_seqlens, sequences = interpreted_layout(lengths)
    k = torch.randn(batch, seq_len, num_heads, key_dim) / math.sqrt(key_dim)
    w = torch.randn(batch, seq_len, num_v_heads, key_dim) / math.sqrt(key_dim)
    u = torch.randn(batch, seq_len, num_v_heads, value_dim)
    g = None
    if gated:
        g = chunk_local_decay(batch, seq_len, num_v_heads, chunk_size, cu_seqlens, "cpu")
    state = (value_dim, key_dim) if state_v_first else (key_dim, value_dim)
    h0 = torch.randn(sequences, num_v_heads, *state) if states else None
    args = dict(g=g, initial_state=h0, output_final_state=states, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size)  # fmt: skip

    expected = chunk_fwd_h_torch(*(x.double() for x in (k, w, u)),
                                 **as_float64(args))  # fmt: skip
    result = chunk_fwd_h_triton(k, w, u, **args, launch=LAUNCH)
    if cu_seqlens is not None:  # with FLA's chunk_indices, as its functions pass them: the same results
        chunk_indices = packed_chunk_indices(lengths, chunk_size)
        with_indices = chunk_fwd_h_triton(k, w, u, **args, chunk_indices=chunk_indices, launch=LAUNCH)
        for got, want in zip(with_indices, result):
            assert (got is None and want is None) or torch.equal(got, want)
    assert_float32_close(("h", "v_new", "final state"), result, expected)


def test_refuses_keys_wider_than_its_tile():
    x = torch.zeros(1, 16, 1, 272)
    with pytest.raises(ValueError, match="K = 272 is over 256"):
        chunk_fwd_h_triton(x, x, torch.zeros(1, 16, 1, 8), launch=LAUNCH)


def test_tuning_leaves_out_settings_whose_tiles_do_not_fit():
    """The H100's 232,448 bytes of shared memory (Triton 3.6 asked 250,376 for BV 64, 8 warps, 3 stages at K 256 in
    bf16 with value-first states); float32 inputs at K 256 fit no setting."""
    h100 = 232448
    assert settings(fitting_configs(256, 64, 2, True, h100)) == [(64, 8, 2)]
    assert settings(fitting_configs(256, 64, 2, False, h100)) == [(64, 8, 2)]
    assert settings(fitting_configs(128, 64, 2, True, h100)) == [(64, 8, 2), (64, 8, 3)]
    assert settings(fitting_configs(128, 64, 4, True, h100)) == [(64, 8, 2)]
    assert fitting_configs(256, 64, 4, True, h100) == []


def test_training_runs_it_only_on_cuda_bf16_inputs():
    assert not serves(torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16), 64, True)
    assert not serves(torch.zeros(1, 64, 1, 128, dtype=torch.float16), 64, True)
