"""Delta rule dispatchers (PyTorch path) against the token-by-token recurrence with g=None (float64,
rtol = atol = 1e-10) and against FLA's head-first PyTorch references (float32, rtol = atol = 1e-5)."""

import pytest
import torch
import torch.nn.functional as F
from fla.ops.delta_rule.naive import delta_rule_chunkwise, delta_rule_recurrence

from flame.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
from flame.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from tests.ops.helpers import assert_all_close, projection_grads

FLOAT64_TOL = {"rtol": 1e-10, "atol": 1e-10}
FLA_FLOAT32_TOL = {"rtol": 1e-5, "atol": 1e-5}
NAMES = ["o", "final_state"]
GRAD_NAMES = ["dq", "dk", "dv", "dbeta", "dh0"]
DISPATCHERS = [chunk_delta_rule, fused_recurrent_delta_rule]


def make_inputs(batch, seq_len, heads, key_dim, value_dim, dtype, seed, num_states=None):
    """Random leaf tensors (q, k, v, beta, h0) in FLA's [B, T, H, ...] layouts, k unit-norm."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q = randn(batch, seq_len, heads, key_dim)
    k = F.normalize(randn(batch, seq_len, heads, key_dim), dim=-1)
    v = randn(batch, seq_len, heads, value_dim)
    beta = torch.sigmoid(randn(batch, seq_len, heads))
    h0 = 0.5 * randn(num_states or batch, heads, key_dim, value_dim)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, beta, h0)]


def head_first(x):
    return x.transpose(1, 2)


@pytest.mark.parametrize("delta_rule", DISPATCHERS)
@pytest.mark.parametrize(("seq_len", "key_dim", "value_dim"), [(37, 16, 24), (130, 32, 16)])
def test_matches_recurrence_in_float64(delta_rule, seq_len, key_dim, value_dim):
    inputs = make_inputs(2, seq_len, 3, key_dim, value_dim, torch.float64, seed=seq_len)
    q, k, v, beta, h0 = inputs
    expected = naive_recurrent_gated_delta_rule(
        q, k, v, None, beta, initial_state=h0, output_final_state=True
    )
    actual = delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    assert_all_close(actual, expected, **FLOAT64_TOL, names=NAMES)
    assert_all_close(
        projection_grads(actual, inputs), projection_grads(expected, inputs), **FLOAT64_TOL, names=GRAD_NAMES
    )


@pytest.mark.parametrize("delta_rule", DISPATCHERS)
def test_matches_fla_naive_recurrence(delta_rule):
    inputs = make_inputs(2, 67, 2, 24, 32, torch.float32, seed=1)
    q, k, v, beta, h0 = inputs
    ours = delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    # FLA's reference is head-first [B, H, T, D] and always scales by 1/sqrt(K).
    fla_o, fla_state = delta_rule_recurrence(
        head_first(q),
        head_first(k),
        head_first(v),
        head_first(beta),
        initial_state=h0,
        output_final_state=True,
    )
    fla = (head_first(fla_o), fla_state)
    assert_all_close(ours, fla, **FLA_FLOAT32_TOL, names=NAMES)
    assert_all_close(
        projection_grads(ours, inputs), projection_grads(fla, inputs), **FLA_FLOAT32_TOL, names=GRAD_NAMES
    )


def test_matches_fla_naive_chunkwise():
    """FLA's chunkwise reference: no initial state, length a multiple of its chunk size, forward only."""
    q, k, v, beta, _ = (x.detach() for x in make_inputs(2, 96, 2, 16, 24, torch.float32, seed=2))
    ours = chunk_delta_rule(q, k, v, beta, output_final_state=True)
    fla_o, fla_state = delta_rule_chunkwise(head_first(q), head_first(k), head_first(v), head_first(beta), 32)
    assert_all_close(ours, (head_first(fla_o), fla_state), **FLA_FLOAT32_TOL, names=NAMES)


@pytest.mark.parametrize("delta_rule", DISPATCHERS)
def test_varlen_and_qk_l2norm(delta_rule):
    boundaries = [0, 5, 64, 67]
    cu_seqlens = torch.tensor(boundaries, dtype=torch.int32)
    inputs = make_inputs(1, 67, 2, 16, 16, torch.float64, seed=3, num_states=3)
    q, k, v, beta, h0 = inputs
    actual = delta_rule(
        q,
        k,
        v,
        beta,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
    )

    def l2norm(x):
        return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)

    outputs, final_states = [], []
    for n, (bos, eos) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        o_n, state_n = naive_recurrent_gated_delta_rule(
            l2norm(q[:, bos:eos]),
            l2norm(k[:, bos:eos]),
            v[:, bos:eos],
            None,
            beta[:, bos:eos],
            initial_state=h0[n : n + 1],
            output_final_state=True,
        )
        outputs.append(o_n)
        final_states.append(state_n)
    expected = (torch.cat(outputs, dim=1), torch.cat(final_states, dim=0))
    assert_all_close(actual, expected, **FLOAT64_TOL, names=NAMES)
    assert_all_close(
        projection_grads(actual, inputs), projection_grads(expected, inputs), **FLOAT64_TOL, names=GRAD_NAMES
    )


def test_fused_recurrent_defaults_beta_to_one():
    q, k, v, beta, _ = make_inputs(1, 37, 2, 16, 16, torch.float64, seed=4)
    actual, _ = fused_recurrent_delta_rule(q, k, v)
    expected, _ = chunk_delta_rule(q, k, v, torch.ones_like(beta))
    torch.testing.assert_close(actual, expected, **FLOAT64_TOL)


def test_rejects_what_fla_does_not_take_on_this_path():
    q, k, v, beta, _ = make_inputs(1, 37, 2, 16, 16, torch.float64, seed=5)
    with pytest.raises(ValueError, match="beta must be"):
        fused_recurrent_delta_rule(q, k, v, beta[..., None].expand(-1, -1, -1, 16))
    with pytest.raises(ValueError, match="same number of heads"):
        chunk_delta_rule(q, k, v.repeat_interleave(2, dim=2), beta)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_delta_rule(q.expand(2, -1, -1, -1), k, v, beta, cu_seqlens=torch.tensor([0, 37]))
