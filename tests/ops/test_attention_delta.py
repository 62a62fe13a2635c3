"""flame.ops.attention_delta: the PyTorch definition against sums written out in float64, the CPU dispatch, and
FLA's modules calling flame's op once flame.compat puts it in place. The Triton kernel's CPU check is
tests/ops/interpreted/test_attention_delta_triton.py; on the GPU, tests/gpu/test_attention_delta.py."""

import importlib

import pytest
import torch

from flame.compat import FLA_ATTENTION_DELTA_MODULES, fla_attention_delta_on_flame
from flame.ops.attention_delta import attention_delta, attention_delta_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_reference_is_each_rows_sum_of_products(dtype):
    generator = torch.Generator().manual_seed(0)
    o = torch.randn(3, 7, 5, 13, generator=generator).to(dtype)
    do = torch.randn(3, 7, 5, 13, generator=generator).to(dtype)
    want = torch.tensor(
        [[[sum(float(a) * float(b) for a, b in zip(o[i, t, h], do[i, t, h], strict=True)) for h in range(5)]
          for t in range(7)] for i in range(3)],
        dtype=torch.float64,
    )  # fmt: skip
    got = attention_delta_torch(o, do)
    assert got.shape == (3, 7, 5) and got.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item())
    torch.testing.assert_close(attention_delta(o, do), got, rtol=0, atol=0)  # the CPU runs the reference


def test_fla_modules_call_flames_op_once_it_is_in_place():
    fla_attention_delta_on_flame(attention_delta)
    fla_attention_delta_on_flame(attention_delta)  # idempotent
    functions = {
        importlib.import_module(name).parallel_attn_bwd_preprocess for name in FLA_ATTENTION_DELTA_MODULES
    }
    assert len(functions) == 1
    (function,) = functions
    assert function.flame_attention_delta and not getattr(
        function.__wrapped__, "flame_attention_delta", False
    )
    o, do = torch.randn(2, 9, 3, 24, dtype=torch.float64), torch.randn(2, 9, 3, 24, dtype=torch.float64)
    torch.testing.assert_close(function(o, do), attention_delta_torch(o, do), rtol=0, atol=0)
