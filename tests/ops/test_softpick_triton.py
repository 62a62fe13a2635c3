"""The softpick Triton kernel's host side on the CPU: argument checks, the ops' fake (meta) implementations, the
dispatch of `attention` (the benchmark script's message without a GPU is test_kernel_benches.py's). The kernels'
numbers are tested under Triton's interpreter (tests/ops/interpreted/test_softpick_triton.py, run by
test_triton_kernels_interpreted.py) and on the GPU (tests/gpu/test_softpick_kernel.py)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flame.ops.attention import attention, reference_attention
from flame.ops.attention.softpick_triton import softpick_attention


def qkv(head_dim=64, heads=4, kv_heads=2, batch=1, seq_len=8, dtype=torch.float32):
    q = torch.randn(batch, seq_len, heads, head_dim, dtype=dtype)
    k = torch.randn(batch, seq_len, kv_heads, head_dim, dtype=dtype)
    return q, k, torch.randn_like(k)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(head_dim=160), "supports head dims up to 128, got 160: use smaller heads, or call"),
        (dict(heads=3), "must be a multiple of key/value heads"),
        (dict(dtype=torch.float64), "must share one of float16/bfloat16/float32"),
        (dict(batch=2, cu_seqlens=torch.tensor([0, 8])), "must have batch size 1"),
        (dict(window_size=0), "window_size must be >= 1"),
        (dict(variant="softmax"), "variant must be one of"),
        (dict(scale=-1.0), "scale must be positive"),
    ],
)
def test_rejects_what_the_kernel_does_not_support(change, message):
    shape = {name: change.pop(name) for name in ("head_dim", "heads", "dtype", "batch") if name in change}
    with pytest.raises(ValueError, match=message):
        softpick_attention(*qkv(**shape), **change)


def test_rejects_different_value_head_dim():
    q, k, _ = qkv()
    with pytest.raises(ValueError, match="of one head dim"):
        softpick_attention(q, k, torch.randn(*k.shape[:3], 32))


def test_fake_implementations_give_the_output_shapes():
    with FakeTensorMode():
        q, k, v = qkv(head_dim=40, seq_len=37, dtype=torch.bfloat16)
        out, lse = torch.ops.flame.softpick_attention_fwd(q, k, v, None, 5, 0.1, "softpick")
        dq, dk, dv = torch.ops.flame.softpick_attention_bwd(out, q, k, v, out, lse, None, 5, 0.1, "rectified")
    assert (out.shape, out.dtype) == (q.shape, torch.bfloat16)
    assert (lse.shape, lse.dtype) == ((1, 4, 37), torch.float32)
    assert [x.shape for x in (dq, dk, dv)] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("impl", ["softpick", "rectified"])
def test_cpu_tensors_run_the_reference(impl):
    q, k, v = qkv(seq_len=13)
    expected = reference_attention(q, k, v, impl=impl, window_size=4)
    assert torch.equal(attention(q, k, v, impl=impl, window_size=4), expected)
