"""flame's Triton kernel for the attention backward's delta (flame/ops/attention_delta/triton_kernel.py), run by
Triton's interpreter on the CPU, against the PyTorch definition evaluated in float64 on the same (rounded) inputs.

Odd sizes: rows of V = 1, 13, 64 and 100 channels (padded to a power of 2 in the kernel), 1 to 3 x 37 x 3 rows, so
the last program's tile is ragged; a transposed (non-contiguous) do. Tolerances, relative to the largest |reference
value|: float32 1e-6 (a float32 sum of at most 100 products), float64 1e-12, bfloat16 inputs 1e-6 (the products
and the sum are float32, as the reference's).
"""

import pytest
import torch

from flame.ops.attention_delta import attention_delta_torch
from flame.ops.attention_delta.triton_kernel import attention_delta_triton

TOLERANCES = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-6}


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 37, 3, 13), (2, 37, 1, 64), (1, 5, 3, 100)], ids=str)
def test_the_kernel_sums_each_row_as_the_reference(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    o = torch.randn(shape, generator=generator).to(dtype)
    do = torch.randn(shape, generator=generator).to(dtype)
    want = attention_delta_torch(o.double(), do.double())
    got = attention_delta_triton(o, do)
    assert got.shape == shape[:-1] and got.dtype == attention_delta_torch(o, do).dtype
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_a_non_contiguous_gradient():
    generator = torch.Generator().manual_seed(1)
    o = torch.randn(2, 11, 3, 24, generator=generator)
    do = torch.randn(2, 3, 11, 24, generator=generator).transpose(1, 2)
    torch.testing.assert_close(
        attention_delta_triton(o, do).double(),
        attention_delta_torch(o.double(), do.double()),
        rtol=1e-6,
        atol=1e-6 * 24,
    )


def test_shapes_that_differ_are_refused():
    with pytest.raises(ValueError, match="differ in shape"):
        attention_delta_triton(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))
