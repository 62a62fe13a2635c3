"""The Gated DeltaNet mixer: parity with FLA's layer math written from FLA's PyTorch references (float32: FLA's
references compute in float32 whatever the input; outputs to 1e-5, gradients to 1e-5 of their largest entry, both
float32 rounding), packed documents against documents run alone (float64, 1e-10), and the decay initialisation."""

import math

import pytest
import torch
import torch.nn.functional as F
from fla.modules.norm.layernorm import rms_norm_ref
from fla.modules.norm.layernorm_gated import rms_norm_ref as gated_rms_norm_ref
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from torch import nn

from flame.models.layers.gated_deltanet import GatedDeltaNet
from tests.models.helpers import packed_and_alone

FLA_TOL = {"rtol": 1e-5, "atol": 1e-5}
FLOAT64_TOL = {"rtol": 1e-10, "atol": 1e-10}
# FLA's in-kernel l2norm: x / sqrt(sum(x^2) + eps) (fla/modules/norm/l2norm.py, l2norm_fwd).
FLA_L2NORM_EPS = 1e-6

CASES = {
    "default": {},
    "grouped_value_heads": {"num_v_heads": 4},
    "neg_eigval_no_gate": {"allow_neg_eigval": True, "use_gate": False},
    "no_short_conv": {"use_short_conv": False},
}


def make_layer(dtype=torch.float32, **overrides) -> GatedDeltaNet:
    torch.manual_seed(0)
    kwargs = {
        "hidden_size": 32,
        "head_dim": 8,
        "num_heads": 2,
        "expand_v": 2.0,
        "norm_eps": 1e-6,
        **overrides,
    }
    layer = GatedDeltaNet(**kwargs).to(dtype)
    with torch.no_grad():  # non-trivial norm weights so that a swapped weight would show
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer


def fla_reference(layer: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """fla/layers/gated_deltanet.py's forward (chunk mode, no cache), with FLA's PyTorch reference functions."""
    batch, seq_len, _ = x.shape

    def short_conv(conv: nn.Conv1d, y: torch.Tensor) -> torch.Tensor:
        # FLA's ShortConvolution is an nn.Conv1d padded by W - 1 on both sides: its first T outputs are causal.
        return F.silu(nn.Conv1d.forward(conv, y.transpose(1, 2))[..., :seq_len].transpose(1, 2))

    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    if layer.use_short_conv:
        q, k, v = short_conv(layer.q_conv1d, q), short_conv(layer.k_conv1d, k), short_conv(layer.v_conv1d, v)
    else:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    q, k = (y.view(batch, seq_len, layer.num_heads, layer.head_dim) for y in (q, k))
    q, k = (y / torch.sqrt(y.square().sum(-1, keepdim=True) + FLA_L2NORM_EPS) for y in (q, k))
    # FLA's kernels serve value head hv from q/k head hv // (HV // H); the reference has no grouping.
    group = layer.num_v_heads // layer.num_heads
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    v = v.view(batch, seq_len, layer.num_v_heads, layer.head_v_dim)
    g = naive_gdn_gate(layer.a_proj(x), layer.A_log, layer.dt_bias)
    beta = layer.b_proj(x).sigmoid() * (2 if layer.allow_neg_eigval else 1)
    o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    if layer.use_gate:
        gate = layer.g_proj(x).view(batch, seq_len, layer.num_v_heads, layer.head_v_dim)
        o = gated_rms_norm_ref(
            o, layer.o_norm.weight, None, z=gate, eps=layer.o_norm.eps, norm_before_gate=True
        )
    else:
        o = rms_norm_ref(o, layer.o_norm.weight, None, eps=layer.o_norm.eps, upcast=True)
    return layer.o_proj(o.reshape(batch, seq_len, -1))


@pytest.mark.parametrize("case", CASES)
def test_matches_fla_reference_forward_and_backward(case):
    layer = make_layer(**CASES[case])
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = layer(x, torch.arange(40).expand(2, -1))
    expected = fla_reference(layer, x)
    torch.testing.assert_close(out, expected, **FLA_TOL)

    params = [x, layer.A_log, layer.dt_bias, layer.q_proj.weight, layer.b_proj.weight, layer.o_norm.weight]
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * cotangent).sum(), params)
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), params)
    for grad, expected_grad in zip(grads, expected_grads):
        # Summed over all tokens, gradients reach ~30; both sides then differ from float64 by ~1e-5 relative.
        torch.testing.assert_close(
            grad, expected_grad, rtol=0, atol=FLA_TOL["atol"] * expected_grad.abs().max()
        )


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_match_documents_alone(case):
    layer = make_layer(torch.float64, **CASES[case])
    generator = torch.Generator().manual_seed(3)
    documents = [torch.randn(1, n, 32, generator=generator, dtype=torch.float64) for n in (5, 70, 1, 23)]
    packed, alone = packed_and_alone(layer, documents)
    torch.testing.assert_close(packed, alone, **FLOAT64_TOL)


def test_decay_initialisation_follows_fla():
    torch.manual_seed(0)
    # Many value heads for tight statistics; a tiny width keeps the projections small.
    layer = GatedDeltaNet(hidden_size=4, head_dim=2, num_heads=1, num_v_heads=20000, expand_v=1.0)
    A = layer.A_log.detach().exp()
    assert 0 < A.min() < 0.01 and 15.99 < A.max() <= 16  # A ~ U(0, 16)
    assert abs(A.mean().item() - 8) < 0.1
    dt = F.softplus(layer.dt_bias.detach())  # dt_bias is the inverse softplus of dt
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert abs(dt.log().mean().item() - (math.log(1e-3) + math.log(0.1)) / 2) < 0.05  # log-uniform

    before = layer.A_log.detach().clone()
    layer.reset_parameters()
    assert not torch.equal(before, layer.A_log)
