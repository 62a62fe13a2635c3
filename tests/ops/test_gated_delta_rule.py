"""Gated delta rule: the chunked PyTorch path and the dispatcher against the token-by-token recurrence (float64,
rtol = atol = 1e-10) and our recurrence and chunked code against FLA's own PyTorch references (float32,
rtol = atol = 1e-5; measured differences are ~1e-7)."""

import pytest
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as fla_naive

from flame.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    gdn_gate,
    naive_recurrent_gated_delta_rule,
)
from tests.ops.helpers import assert_all_close, projection_grads

FLOAT64_TOL = {"rtol": 1e-10, "atol": 1e-10}
FLA_FLOAT32_TOL = {"rtol": 1e-5, "atol": 1e-5}
NAMES = ["o", "final_state"]
GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]


def make_inputs(batch, seq_len, heads, value_heads, key_dim, value_dim, dtype, seed, num_states=None):
    """Random leaf tensors (q, k, v, g, beta, h0) in FLA's layouts; k unit-norm and g <= 0 as in a real model."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q = randn(batch, seq_len, heads, key_dim)
    k = F.normalize(randn(batch, seq_len, heads, key_dim), dim=-1)
    v = randn(batch, seq_len, value_heads, value_dim)
    g = F.logsigmoid(randn(batch, seq_len, value_heads) + 2)
    beta = torch.sigmoid(randn(batch, seq_len, value_heads))
    h0 = 0.5 * randn(num_states or batch, value_heads, key_dim, value_dim)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta, h0)]


@pytest.mark.parametrize(
    ("seq_len", "heads", "value_heads", "key_dim", "value_dim", "chunk_size"),
    [(37, 2, 2, 16, 24, 16), (67, 1, 3, 24, 16, 32), (130, 2, 4, 32, 16, 64)],
)
def test_chunk_matches_recurrence_in_float64(seq_len, heads, value_heads, key_dim, value_dim, chunk_size):
    inputs = make_inputs(2, seq_len, heads, value_heads, key_dim, value_dim, torch.float64, seed=seq_len)
    q, k, v, g, beta, h0 = inputs
    expected = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    actual = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size
    )
    assert_all_close(actual, expected, **FLOAT64_TOL, names=NAMES)
    assert_all_close(
        projection_grads(actual, inputs), projection_grads(expected, inputs), **FLOAT64_TOL, names=GRAD_NAMES
    )


def test_scale_argument_and_no_initial_state():
    q, k, v, g, beta, _ = make_inputs(1, 37, 2, 2, 16, 16, torch.float64, seed=1)
    expected, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3)
    actual, final_state = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3)
    assert final_state is None
    torch.testing.assert_close(actual, expected, **FLOAT64_TOL)


def test_recurrence_matches_fla_naive_recurrent():
    inputs = make_inputs(2, 67, 3, 3, 32, 24, torch.float32, seed=2)
    q, k, v, g, beta, h0 = inputs
    ours = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    # FLA's reference takes beta before g.
    fla = fla_naive(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    assert_all_close(ours, fla, **FLA_FLOAT32_TOL, names=NAMES)
    assert_all_close(
        projection_grads(ours, inputs), projection_grads(fla, inputs), **FLA_FLOAT32_TOL, names=GRAD_NAMES
    )


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_matches_fla_naive_chunk(chunk_size):
    inputs = make_inputs(2, 130, 2, 2, 32, 16, torch.float32, seed=3)
    q, k, v, g, beta, h0 = inputs
    ours = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size
    )
    fla = naive_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=64, initial_state=h0, output_final_state=True
    )
    assert_all_close(ours, fla, **FLA_FLOAT32_TOL, names=NAMES)
    assert_all_close(
        projection_grads(ours, inputs), projection_grads(fla, inputs), **FLA_FLOAT32_TOL, names=GRAD_NAMES
    )


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_varlen_equals_documents_run_separately(index_dtype):
    boundaries = [0, 30, 31, 97, 130]
    cu_seqlens = torch.tensor(boundaries, dtype=index_dtype)
    inputs = make_inputs(1, 130, 1, 2, 16, 24, torch.float64, seed=4, num_states=len(boundaries) - 1)
    q, k, v, g, beta, h0 = inputs
    packed = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=16
    )

    outputs, final_states = [], []
    for n, (bos, eos) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        o_n, state_n = chunk_gated_delta_rule(
            *(x[:, bos:eos] for x in (q, k, v, g, beta)),
            initial_state=h0[n : n + 1],
            output_final_state=True,
            chunk_size=16,
        )
        outputs.append(o_n)
        final_states.append(state_n)
    separate = (torch.cat(outputs, dim=1), torch.cat(final_states, dim=0))
    assert_all_close(packed, separate, **FLOAT64_TOL, names=NAMES)

    recurrence = naive_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens
    )
    assert_all_close(
        projection_grads(packed, inputs),
        projection_grads(recurrence, inputs),
        **FLOAT64_TOL,
        names=GRAD_NAMES,
    )


def test_value_head_hv_reads_query_key_head_hv_over_group():
    """FLA maps value head hv to q/k head hv // (HV // H) (repeat_interleave, not tile)."""
    q, k, v, g, beta, h0 = make_inputs(2, 37, 2, 6, 16, 16, torch.float64, seed=5)
    grouped = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    repeated = chunk_gated_delta_rule(
        q.repeat_interleave(3, dim=2),
        k.repeat_interleave(3, dim=2),
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
    )
    assert_all_close(grouped, repeated, **FLOAT64_TOL, names=NAMES)
    tiled, _ = chunk_gated_delta_rule(
        q.repeat(1, 1, 3, 1), k.repeat(1, 1, 3, 1), v, g, beta, initial_state=h0
    )
    assert not torch.allclose(grouped[0], tiled)


def test_in_kernel_options_match_explicit_preprocessing():
    """l2norm of q/k (eps 1e-6 inside the sqrt), 2 * sigmoid(beta), the GDN gate and the value-first state."""
    q, k, v, a, b, h0 = make_inputs(2, 67, 2, 4, 16, 24, torch.float64, seed=6)
    generator = torch.Generator().manual_seed(7)
    A_log = torch.log(torch.rand(4, generator=generator, dtype=torch.float64) * 16).requires_grad_()
    dt_bias = torch.randn(4, generator=generator, dtype=torch.float64).requires_grad_()
    h0_value_first = h0.transpose(-1, -2).detach().clone().requires_grad_()
    inputs = [q, k, v, a, b, h0_value_first, A_log, dt_bias]

    actual = chunk_gated_delta_rule(
        q,
        k,
        v,
        a,
        b,
        initial_state=h0_value_first,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=True,
        state_v_first=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
    )
    o, final_state = naive_recurrent_gated_delta_rule(
        q / torch.sqrt(q.square().sum(-1, keepdim=True) + 1e-6),
        k / torch.sqrt(k.square().sum(-1, keepdim=True) + 1e-6),
        v,
        -A_log.exp() * F.softplus(a + dt_bias),
        2 * torch.sigmoid(b),
        initial_state=h0_value_first.transpose(-1, -2),
        output_final_state=True,
    )
    expected = (o, final_state.transpose(-1, -2))
    assert actual[1].shape == (2, 4, 24, 16)
    assert_all_close(actual, expected, **FLOAT64_TOL, names=NAMES)
    assert_all_close(
        projection_grads(actual, inputs),
        projection_grads(expected, inputs),
        **FLOAT64_TOL,
        names=["dq", "dk", "dv", "da", "db", "dh0", "dA_log", "ddt_bias"],
    )


def test_gate_matches_fla_reference():
    generator = torch.Generator().manual_seed(8)
    a = 10 * torch.randn(3, 37, 4, generator=generator)  # reaches softplus's linear regime (x > 20)
    A_log = torch.log(torch.rand(4, generator=generator) * 16)
    dt_bias = torch.randn(4, generator=generator)
    torch.testing.assert_close(gdn_gate(a, A_log, dt_bias), naive_gdn_gate(a, A_log, dt_bias))
    torch.testing.assert_close(gdn_gate(a, A_log), naive_gdn_gate(a, A_log))


def test_bfloat16_inputs_give_bfloat16_output_and_float32_state():
    q, k, v, g, beta, h0 = make_inputs(1, 37, 2, 2, 16, 16, torch.bfloat16, seed=9)
    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16
    assert final_state.dtype == torch.float32
    expected_o, expected_state = chunk_gated_delta_rule(
        *(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(), output_final_state=True
    )
    torch.testing.assert_close(o, expected_o.bfloat16())
    torch.testing.assert_close(final_state, expected_state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch": 2, "cu_seqlens": torch.tensor([0, 10, 37])}, "batch size 1"),
        ({"initial_state_count": 3}, "one initial state per sequence"),
        ({"value_heads": 3}, "multiple of query/key heads"),
        ({"allow_neg_eigval": True}, "requires use_beta_sigmoid_in_kernel"),
        ({"use_gate_in_kernel": True}, "requires A_log"),
        ({"chunk_size": 48}, "chunk_size"),
    ],
)
def test_invalid_arguments_are_rejected(kwargs, message):
    kwargs = dict(kwargs)
    batch = kwargs.pop("batch", 1)
    value_heads = kwargs.pop("value_heads", 2)
    initial_state_count = kwargs.pop("initial_state_count", None)
    q, k, v, g, beta, h0 = make_inputs(batch, 37, 2, value_heads, 16, 16, torch.float64, seed=11)
    if initial_state_count is not None:
        kwargs["initial_state"] = h0.detach().expand(initial_state_count, -1, -1, -1)
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
