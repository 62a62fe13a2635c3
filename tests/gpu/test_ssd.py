"""Mamba-2's scan on the GPU (flame.ops.ssd on CUDA tensors: FLA's chunk_simple_gla) against the token-by-token
recurrence in float64 on the same inputs: y, the last state and the gradients of x, dt, A, B and C.

Odd sizes (lengths past a chunk border, an odd head count, widths that are not powers of two). Limits on the relative
RMS error ||ours - ref|| / ||ref|| of each tensor: 1e-5 in float32 with IEEE products (``exact_float32``, Triton's
kernels only: ``fla_tilelang_off``); 2e-2 in float32 as training runs it, with Triton's default TF32 products, or
FLA's TileLang dq/dk/dg where it serves the call (tilelang installed and flame's Hopper kernel not registered:
flame.compat.serve_gated_dqkwg_on_hopper ranks flame's ahead of it for this call; 1.1e-2 measured with TileLang's on
an H200, in the gradients of dt and A); 2e-2 with bfloat16 x, B and C (dt and A float32).
"""

import pytest
import torch

from flame.ops import dispatch
from flame.ops.ssd import fla_ssd, ssd
from flame.ops.ssd.naive import ssd_recurrent

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [  # batch, T, heads, head_dim, state
    (2, 130, 3, 24, 48),
    (1, 257, 2, 64, 128),
]
NAMES = ("y", "last state", "dx", "ddt", "dA", "dB", "dC")


def rms_ratio(ours: torch.Tensor, reference: torch.Tensor) -> float:
    ours, reference = ours.double().cpu(), reference.double().cpu()
    return ((ours - reference).square().mean().sqrt() / reference.square().mean().sqrt()).item()


def results(scan, args, dy):
    leaves = [t.detach().clone().requires_grad_() for t in args]
    y, state = scan(*leaves)
    return [y, state, *torch.autograd.grad(y, leaves, dy.to(y.dtype))]


def inputs(batch, length, heads, head_dim, state, low_precision=torch.float32):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, heads, head_dim, generator=generator, dtype=torch.float64)
    dt = torch.nn.functional.softplus(
        torch.randn(batch, length, heads, generator=generator, dtype=torch.float64) - 1
    )
    A = -torch.rand(heads, generator=generator, dtype=torch.float64) * 2 - 0.1
    B = torch.randn(batch, length, heads, state, generator=generator, dtype=torch.float64)
    C = torch.randn(batch, length, heads, state, generator=generator, dtype=torch.float64)
    dy = torch.randn(batch, length, heads, head_dim, generator=generator, dtype=torch.float64)
    # Rounded once to the kernel's input dtypes; the reference takes the rounded values in float64.
    x, B, C = (t.to(low_precision) for t in (x, B, C))
    return [t.cuda() for t in (x, dt.float(), A.float(), B, C)], dy.cuda()


def check(shape, dtype, limit):
    args, dy = inputs(*shape, low_precision=dtype)
    reference = results(ssd_recurrent, [t.double().cpu() for t in args], dy.cpu())
    assert dispatch._TABLE["ssd"].implementation(*args) is fla_ssd
    ours = results(ssd, args, dy)
    errors = {name: rms_ratio(o, r) for name, o, r in zip(NAMES, ours, reference, strict=True)}
    assert ours[0].dtype == dtype and ours[1].shape == reference[1].shape
    assert max(errors.values()) <= limit, errors


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_with_ieee_products(shape, exact_float32, fla_tilelang_off):
    check(shape, torch.float32, 1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_as_training_runs_it(shape):
    check(shape, torch.float32, 2e-2)


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16(shape):
    check(shape, torch.bfloat16, 2e-2)
