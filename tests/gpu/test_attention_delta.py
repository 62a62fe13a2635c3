"""flame's attention-delta kernel on the GPU against the float64 definition and against FLA 0.6.0's own kernel
(which it replaces in FLA's attention backwards), bfloat16 and float32 inputs of odd sizes: float32 sums of at most
100 products, so 1e-5 relative to the largest |value|; the op's CUDA dispatch runs flame's kernel."""

import pytest
import torch

from flame.ops.attention_delta import ATTENTION_DELTA, attention_delta, attention_delta_torch
from flame.ops.attention_delta.triton_kernel import attention_delta_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
RTOL = 1e-5


def fla_kernel(o, do):
    from fla.ops.attn import parallel

    function = parallel.parallel_attn_bwd_preprocess
    return getattr(function, "__wrapped__", function)(o, do)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape", [(3, 331, 5, 64), (2, 257, 64, 64), (1, 97, 3, 100), (2, 129, 4, 128)], ids=str
)
def test_flames_kernel_equals_the_definition_and_flas_kernel(shape, dtype):
    generator = torch.Generator(device="cuda").manual_seed(sum(shape))
    o = torch.randn(shape, device="cuda", generator=generator).to(dtype)
    do = torch.randn(shape, device="cuda", generator=generator).to(dtype)
    want = attention_delta_torch(o.double(), do.double())
    got = attention_delta_triton(o, do)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=RTOL * scale)
    torch.testing.assert_close(got, fla_kernel(o, do), rtol=RTOL, atol=RTOL * scale)
    torch.testing.assert_close(attention_delta(o, do), got, rtol=0, atol=0)
    assert ATTENTION_DELTA.choose(o, do)[0] == "triton"
