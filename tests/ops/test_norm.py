"""RMSNorm, gated RMSNorm and l2norm against FLA's PyTorch references (`rms_norm_ref` of fla.modules.norm.layernorm
and layernorm_gated, which upcast to float32 as FLA's kernels do) and against the formulas written out.
float32: rtol = atol = 1e-6; bfloat16 outputs must match the reference exactly (same float32 math, one cast)."""

import pytest
import torch
import torch.nn.functional as F
from fla.modules.norm.layernorm import rms_norm_ref
from fla.modules.norm.layernorm_gated import rms_norm_ref as gated_rms_norm_ref

from flame.ops.norm import gated_rms_norm, l2norm, rms_norm

FLOAT32_TOL = {"rtol": 1e-6, "atol": 1e-6}
EXACT = {"rtol": 0, "atol": 0}


def random(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, FLOAT32_TOL), (torch.bfloat16, EXACT)])
def test_rms_norm_matches_fla_reference(dtype, tol):
    x = 3 * random(2, 37, 48, seed=0, dtype=dtype)
    weight = 1 + 0.1 * random(48, seed=1)  # FLA keeps norm weights in float32 even for bf16 activations
    y = rms_norm(x, weight, eps=1e-5)
    assert y.dtype == dtype
    torch.testing.assert_close(y, rms_norm_ref(x, weight, None, eps=1e-5, upcast=True), **tol)


def test_rms_norm_without_weight():
    x = random(5, 24, seed=2, dtype=torch.float64)
    expected = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, None, eps=1e-6), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ["swish", "silu"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, FLOAT32_TOL), (torch.bfloat16, EXACT)])
def test_gated_rms_norm_matches_fla_reference(activation, dtype, tol):
    """FusedRMSNormGated: the gate multiplies after normalisation and weight (norm_before_gate=True)."""
    x = random(2, 37, 3, 32, seed=3, dtype=dtype)
    gate = 2 * random(2, 37, 3, 32, seed=4, dtype=dtype)
    weight = 1 + 0.1 * random(32, seed=5)
    y = gated_rms_norm(x, gate, weight, eps=1e-5, activation=activation)
    assert y.dtype == dtype
    expected = gated_rms_norm_ref(x, weight, None, z=gate, eps=1e-5, norm_before_gate=True, upcast=True)
    torch.testing.assert_close(y, expected, **tol)


def test_gated_rms_norm_sigmoid_gate():
    x, gate = random(7, 24, seed=6, dtype=torch.float64), random(7, 24, seed=7, dtype=torch.float64)
    weight = random(24, seed=8, dtype=torch.float64)
    expected = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-5) * weight * torch.sigmoid(gate)
    y = gated_rms_norm(x, gate, weight, eps=1e-5, activation="sigmoid")
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="activation"):
        gated_rms_norm(x, gate, weight, eps=1e-5, activation="relu")


def test_l2norm_puts_eps_inside_the_square_root():
    """FLA's in-kernel l2norm: x / sqrt(sum(x^2) + 1e-6); F.normalize divides by max(||x||, eps) instead."""
    x = torch.cat(
        [random(4, 16, seed=9, dtype=torch.float64), 1e-4 * random(1, 16, seed=10, dtype=torch.float64)]
    )
    expected = x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(l2norm(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l2norm(x[:4]), F.normalize(x[:4], dim=-1), rtol=1e-5, atol=1e-6)
    assert l2norm(x[4:]).norm() < 0.5  # a tiny vector is not blown up to unit norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_residual_rms_norm_matches_fla_reference(dtype, with_residual):
    """FLA's rms_norm with a residual, a bias and prenorm (its RMSNorm modules' call, which compiled blocks run as
    residual_rms_norm_torch): y and the summed residual as FLA's upcast reference gives them; the residual comes back
    in the residual's dtype, float32 without one under residual_in_fp32, as FLA's kernel returns it."""
    from flame.ops.norm import residual_rms_norm_torch

    x = 3 * random(2, 37, 45, seed=0, dtype=dtype)
    residual = random(2, 37, 45, seed=1, dtype=dtype) if with_residual else None
    weight, bias = 1 + 0.1 * random(45, seed=2), 0.1 * random(45, seed=3)
    y, summed = residual_rms_norm_torch(x, weight, bias, residual, 1e-5, prenorm=True, residual_in_fp32=True)
    ref_y, ref_summed = rms_norm_ref(x, weight, bias, residual, eps=1e-5, prenorm=True, upcast=True)
    assert y.dtype == dtype and summed.dtype == (dtype if with_residual else torch.float32)
    tol = FLOAT32_TOL if dtype == torch.float32 else EXACT
    torch.testing.assert_close(y, ref_y, **tol)
    torch.testing.assert_close(summed, ref_summed.to(summed.dtype), **EXACT)
    alone = residual_rms_norm_torch(x, weight, None, residual, 1e-5)
    torch.testing.assert_close(alone, rms_norm_ref(x, weight, None, residual, eps=1e-5, upcast=True), **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("group_size", [None, 9])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_group_rms_norm_gated_matches_fla_reference(dtype, group_size, norm_before_gate, gated):
    """FLA's rmsnorm_fn (Mamba2's and Mamba3's RMSNormGated, which compiled blocks run as group_rms_norm_gated_torch)
    against FLA's PyTorch reference of it (layernorm_gated.rms_norm_ref), with a bias, per group of 9 of 45 channels
    or over all of them, the gate after or before the norm or none: within 1e-12 in float64, equal in bfloat16 (one
    rounding of the same float32 values)."""
    from flame.ops.norm import group_rms_norm_gated_torch

    x = 3 * random(2, 37, 45, seed=0, dtype=dtype)
    z = random(2, 37, 45, seed=1, dtype=dtype) if gated else None
    weight, bias = 1 + 0.1 * random(45, seed=2), 0.1 * random(45, seed=3)
    ours = group_rms_norm_gated_torch(x, weight, bias, z, 1e-5, group_size, norm_before_gate)
    if dtype == torch.float64:  # FLA's reference upcasts to float32; in float64 it keeps x's precision
        expected = gated_rms_norm_ref(
            x, weight.double(), bias.double(), z, 1e-5, group_size, norm_before_gate, False
        )
        tol = {"rtol": 1e-12, "atol": 1e-12}
    else:
        expected = gated_rms_norm_ref(x, weight, bias, z, 1e-5, group_size, norm_before_gate)
        tol = EXACT
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, expected, **tol)
