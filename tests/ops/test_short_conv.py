"""Short causal depthwise convolution against a direct loop over taps (float64, rtol = atol = 1e-12) and against the
nn.Conv1d forward of FLA's ShortConvolution module (which instantiates on CPU; only its Triton forward does not)."""

import pytest
import torch
import torch.nn.functional as F
from fla.modules import ShortConvolution

from flame.ops import dispatch
from flame.ops.short_conv import MAX_GROUP, short_conv, short_conv_group, short_conv_torch

FLOAT64_TOL = {"rtol": 1e-12, "atol": 1e-12}


def direct_loop(x, weight, bias, activation, boundaries):
    """y[t] = act(bias + sum_i weight[:, W-1-i] * x[t-i]) over taps inside the token's document, one by one."""
    width = weight.shape[-1]
    y = torch.zeros_like(x)
    for bos, eos in zip(boundaries[:-1], boundaries[1:]):
        for t in range(bos, eos):
            acc = torch.zeros_like(x[:, t]) if bias is None else bias.expand_as(x[:, t]).clone()
            for i in range(width):
                if t - i >= bos:
                    acc = acc + weight[:, width - 1 - i] * x[:, t - i]
            y[:, t] = F.silu(acc) if activation is not None else acc
    return y


def random(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_direct_loop(width, activation, with_bias):
    x = random(2, 37, 24, seed=width)
    weight = random(24, width, seed=10 + width)
    bias = random(24, seed=20) if with_bias else None
    expected = direct_loop(x, weight, bias, activation, [0, 37])
    torch.testing.assert_close(short_conv(x, weight, bias, activation), expected, **FLOAT64_TOL)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_varlen_never_reads_across_documents(index_dtype):
    boundaries = [0, 1, 3, 40, 67]
    cu_seqlens = torch.tensor(boundaries, dtype=index_dtype)
    x = random(1, 67, 16, seed=1)
    weight, bias = random(16, 4, seed=2), random(16, seed=3)
    packed = short_conv(x, weight, bias, "silu", cu_seqlens=cu_seqlens)
    torch.testing.assert_close(packed, direct_loop(x, weight, bias, "silu", boundaries), **FLOAT64_TOL)
    separate = torch.cat(
        [
            short_conv(x[:, bos:eos], weight, bias, "silu")
            for bos, eos in zip(boundaries[:-1], boundaries[1:])
        ],
        dim=1,
    )
    torch.testing.assert_close(packed, separate, **FLOAT64_TOL)


@pytest.mark.parametrize("kernel_size", [3, 4])
def test_takes_fla_short_convolution_weights(kernel_size):
    """FLA's ShortConvolution is nn.Conv1d(D, D, W, groups=D, padding=W-1): weight [D, 1, W], output cut to T."""
    module = ShortConvolution(hidden_size=24, kernel_size=kernel_size, bias=True, activation="silu").double()
    assert module.weight.shape == (24, 1, kernel_size)
    x = random(2, 37, 24, seed=4)
    with torch.no_grad():
        expected = F.silu(torch.nn.Conv1d.forward(module, x.transpose(1, 2))[..., :37]).transpose(1, 2)
        from_module_layout = short_conv(x, module.weight, module.bias, module.activation)
        from_flat_layout = short_conv(x, module.weight[:, 0], module.bias, module.activation)
    torch.testing.assert_close(from_module_layout, expected, **FLOAT64_TOL)
    torch.testing.assert_close(from_flat_layout, expected, **FLOAT64_TOL)


def test_gradients_with_gradcheck():
    x = random(1, 7, 3, seed=5).requires_grad_()
    weight = random(3, 1, 3, seed=6).requires_grad_()
    bias = random(3, seed=7).requires_grad_()
    cu_seqlens = torch.tensor([0, 2, 7])
    assert torch.autograd.gradcheck(
        lambda x, w, b: short_conv_torch(x, w, b, "silu", cu_seqlens=cu_seqlens), (x, weight, bias)
    )


def test_bfloat16_is_computed_in_float32():
    x = random(1, 37, 16, seed=8, dtype=torch.bfloat16)
    weight = random(16, 4, seed=9, dtype=torch.bfloat16)
    y = short_conv(x, weight, activation="silu")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y, short_conv(x.float(), weight.float(), activation="silu").bfloat16(), rtol=0, atol=0
    )


def test_rejects_bad_arguments():
    x = random(1, 5, 4, seed=10)
    with pytest.raises(ValueError, match="activation"):
        short_conv(x, random(4, 3, seed=11), activation="relu")
    with pytest.raises(ValueError, match="depthwise"):
        short_conv(x, random(4, 2, 3, seed=12))
    with pytest.raises(ValueError, match="batch size 1"):
        short_conv(x.expand(2, -1, -1), random(4, 3, seed=13), cu_seqlens=torch.tensor([0, 5]))


def test_a_group_equals_each_convolution_alone_and_calls_once_per_shared_shape(monkeypatch):
    """short_conv_group: each member's output as short_conv gives it, in order; members of one shape, dtype, width,
    bias presence and activation go to one call of the op, at most MAX_GROUP of them."""
    calls = []
    entry = dispatch._TABLE["short_conv"]
    torch_impl = entry.torch_impl

    def counted(x, weight, bias, activation, cu_seqlens, more=()):
        calls.append((1 + len(more), activation))
        return torch_impl(x, weight, bias, activation, cu_seqlens, more)

    monkeypatch.setattr(entry, "torch_impl", counted)
    x, wide, short = random(2, 37, 24, seed=1), random(2, 37, 40, seed=2), random(2, 30, 24, seed=3)
    members = [
        (x, random(24, 4, seed=4), random(24, seed=5), "silu"),
        (short, random(24, 4, seed=6), random(24, seed=7), "silu"),  # another length
        (wide, random(40, 1, 4, seed=8), random(40, seed=9), "silu"),  # more channels: runs with the first
        (x, random(24, 3, seed=10), random(24, seed=11), "silu"),  # another width
        (x, random(24, 4, seed=12), None, "silu"),  # no bias
        (x, random(24, 4, seed=30), random(24, seed=31), None),  # another activation
        *[(x, random(24, 4, seed=13 + i), random(24, seed=20 + i), "silu") for i in range(MAX_GROUP)],
    ]
    outputs = short_conv_group(members)
    # The first, the wider one and the last three: MAX_GROUP (3) and 2; the length, width, bias and activation odd
    # ones alone.
    assert sorted(calls, key=str) == sorted(
        [(1, "silu"), (1, "silu"), (1, "silu"), (1, None), (2, "silu"), (MAX_GROUP, "silu")], key=str
    )
    assert [y.shape for y in outputs] == [member[0].shape for member in members]
    for y, member in zip(outputs, members, strict=True):
        torch.testing.assert_close(y, short_conv(*member), rtol=0, atol=0)
