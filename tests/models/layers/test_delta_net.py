"""The DeltaNet mixer: parity with FLA's layer math written from FLA's PyTorch references (float32, as FLA's
references compute in float32; outputs to 1e-5, gradients to 1e-5 of their largest entry), on both sides of the
64-token switch between the fused-recurrent and chunked ops, and packed documents against documents run alone
(float64, 1e-10)."""

import pytest
import torch
import torch.nn.functional as F
from fla.layers.delta_net import sum_norm
from fla.modules.norm.layernorm import rms_norm_ref
from fla.modules.norm.layernorm_gated import rms_norm_ref as gated_rms_norm_ref
from fla.ops.delta_rule.naive import delta_rule_recurrence
from torch import nn

from flame.models.layers.delta_net import DeltaNet
from tests.models.helpers import packed_and_alone

FLA_TOL = 1e-5
FLOAT64_TOL = {"rtol": 1e-10, "atol": 1e-10}
FLA_L2NORM_EPS = 1e-6  # FLA's in-kernel l2norm: x / sqrt(sum(x^2) + eps)

CASES = {
    "default": {},
    "gate_neg_eigval_expand": {"use_gate": True, "allow_neg_eigval": True, "expand_k": 0.5, "expand_v": 2.0},
    "relu_sum_norm": {"qk_activation": "relu", "qk_norm": "sum"},
    "elu_no_beta": {"qk_activation": "elu", "use_beta": False},
    "identity_no_conv": {"qk_activation": "identity", "use_short_conv": False},
    "silu_no_conv": {"use_short_conv": False},
}


def make_layer(dtype=torch.float32, **overrides) -> DeltaNet:
    torch.manual_seed(0)
    layer = DeltaNet(**{"hidden_size": 32, "num_heads": 4, "norm_eps": 1e-6, **overrides}).to(dtype)
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer


def fla_reference(layer: DeltaNet, x: torch.Tensor) -> torch.Tensor:
    """fla/layers/delta_net.py's forward (no cache), with FLA's PyTorch reference functions."""
    batch, seq_len, _ = x.shape

    def short_conv(conv: nn.Conv1d, y: torch.Tensor, activation: bool) -> torch.Tensor:
        y = nn.Conv1d.forward(conv, y.transpose(1, 2))[..., :seq_len].transpose(1, 2)
        return F.silu(y) if activation else y

    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    silu_qk = layer.qk_activation == "silu"
    if layer.use_short_conv:
        q, k = short_conv(layer.q_conv1d, q, silu_qk), short_conv(layer.k_conv1d, k, silu_qk)
        v = short_conv(layer.v_conv1d, v, True)
    else:
        if silu_qk:
            q, k = F.silu(q), F.silu(k)
        v = F.silu(v)
    q, k = (y.view(batch, seq_len, layer.num_heads, -1) for y in (q, k))
    v = v.view(batch, seq_len, layer.num_heads, -1)
    if layer.qk_activation == "relu":
        q, k = q.relu(), k.relu()
    elif layer.qk_activation == "elu":
        q, k = F.elu(q) + 1, F.elu(k) + 1  # FLA's elu_p1
    if layer.qk_norm == "sum":
        q, k = sum_norm(q), sum_norm(k)
    else:
        q, k = (y / torch.sqrt(y.square().sum(-1, keepdim=True) + FLA_L2NORM_EPS) for y in (q, k))
    beta = layer.b_proj(x).sigmoid() if layer.use_beta else torch.ones_like(q[..., 0])
    beta = beta * (2 if layer.allow_neg_eigval else 1)
    o, _ = delta_rule_recurrence(*(y.transpose(1, 2) for y in (q, k, v, beta)))
    o = o.transpose(1, 2)
    if layer.use_gate:
        gate = layer.g_proj(x).view(batch, seq_len, layer.num_heads, -1)
        o = gated_rms_norm_ref(
            o, layer.o_norm.weight, None, z=gate, eps=layer.o_norm.eps, norm_before_gate=True
        )
    else:
        o = rms_norm_ref(o, layer.o_norm.weight, None, eps=layer.o_norm.eps, upcast=True)
    return layer.o_proj(o.reshape(batch, seq_len, -1))


# Every case through the fused-recurrent op (<= 64 tokens); two through the chunked op (the op is all that changes).
PARITY_RUNS = [(case, 30) for case in CASES] + [("default", 70), ("gate_neg_eigval_expand", 70)]


@pytest.mark.parametrize(("case", "seq_len"), PARITY_RUNS)
def test_matches_fla_reference_forward_and_backward(case, seq_len):
    layer = make_layer(**CASES[case])
    x = torch.randn(2, seq_len, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = layer(x, torch.arange(seq_len).expand(2, -1))
    expected = fla_reference(layer, x)
    torch.testing.assert_close(out, expected, rtol=FLA_TOL, atol=FLA_TOL)

    params = [x, layer.q_proj.weight, layer.v_proj.weight, layer.o_norm.weight]
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * cotangent).sum(), params)
    expected_grads = torch.autograd.grad((expected * cotangent).sum(), params)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=FLA_TOL * expected_grad.abs().max())


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_match_documents_alone(case):
    layer = make_layer(torch.float64, **CASES[case])
    generator = torch.Generator().manual_seed(3)
    # Packed, 99 tokens take the chunked op; alone, each document takes the fused-recurrent one.
    documents = [torch.randn(1, n, 32, generator=generator, dtype=torch.float64) for n in (5, 60, 1, 33)]
    packed, alone = packed_and_alone(layer, documents)
    torch.testing.assert_close(packed, alone, **FLOAT64_TOL)
