"""flame's PyTorch versions of FLA's activations (flame/ops/activations.py) against the formulas in float64 on odd
shapes: float32 inputs to rtol = atol = 1e-6 (the linear's 29-term sums: 1e-5 of their largest value); bfloat16 inputs give bfloat16 results rounded once from the float32
value (one bfloat16 ulp: rtol 2^-8). FLA's Triton kernels are compared on the GPU (tests/gpu/test_fla_compiled_blocks.py)."""

import pytest
import torch

from flame.ops import activations

TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 2**-8, "atol": 1e-6}}


def random(*shape, seed):
    return 4 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def sig(x):
    return 1 / (1 + torch.exp(-x))


CASES = {
    "swish": (lambda x, y, w, b: (x,), lambda x, y, w, b: x * sig(x)),
    "swiglu": (lambda x, y, w, b: (x, y), lambda x, y, w, b: x * sig(x) * y),
    "swiglu_linear": (lambda x, y, w, b: (x, y, w, b), lambda x, y, w, b: (x * sig(x) * y) @ w.T + b),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_activation_matches_its_formula(name, dtype):
    arguments, formula = CASES[name]
    x, y, w, b = (
        random(3, 17, 29, seed=0),
        random(3, 17, 29, seed=1),
        random(7, 29, seed=2) / 8,
        random(7, seed=3),
    )
    rounded = [t.to(dtype) for t in (x, y, w, b)]
    out = getattr(activations, name)(*arguments(*rounded))
    assert out.dtype == dtype
    expected = formula(*(t.double() for t in rounded))
    if name == "swiglu_linear":  # the linear runs in the inputs' dtype on the rounded swiglu
        expected = (activations.swiglu(*rounded[:2]).double()) @ rounded[2].double().T + rounded[3].double()
    tol = dict(TOL[dtype])
    if name == "swiglu_linear" and dtype == torch.float32:
        tol = {"rtol": 1e-5, "atol": 1e-5 * expected.abs().max().item()}
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), **tol)
