"""flame's Triton short-conv kernels (flame/ops/short_conv/triton_kernel.py), run by Triton's interpreter on the CPU, against the
PyTorch reference `short_conv_torch` evaluated in float64 on the same (rounded) inputs.

Odd sizes (D = 37, T = 45, batch 3; packed documents of lengths 1, 2, 17, 3, 30, some shorter than the kernel),
widths 1 to 8, with and without bias and SiLU, weights [D, W] and [D, 1, W]. The interpreter runs programs of 4
spans of 8 tokens x 32 channels, so that every case crosses span, program (32-token chunk) and channel-block edges
and ends in ragged blocks. Outputs and the gradients dx, dweight, dbias (of one fixed output gradient) are
compared with torch.testing.assert_close, atol scaled by the largest |reference value| of each tensor (dweight and
dbias are sums over all B x T tokens, whose float32 rounding grows with their size):
- float32: rtol = 1e-5, atol = 1e-5 x max |reference|;
- float64: rtol = 1e-12, atol = 1e-12 x max |reference|;
- bfloat16 (x, weight, bias and dy in bfloat16, as in mixed-precision training): rtol = 2^-7 (one bfloat16 ulp:
  y, dx, dweight and dbias are float32 sums rounded once to bfloat16) and atol = 1e-2 x max |reference| (values
  near 0 after cancellation);
- bfloat16 x and dy with a float32 weight and bias: rtol = atol / max |reference| = 2^-7 for y and dx, 1e-5 for
  the float32 dweight and dbias.
"""

import pytest
import torch

from flame.ops.short_conv import short_conv_torch
from flame.ops.short_conv import triton_kernel as kernels
from flame.ops.short_conv.triton_kernel import (
    short_conv_bwd,
    short_conv_fwd,
    short_conv_group_triton,
    short_conv_triton,
)

# dtype: (rtol, atol relative to the largest |reference value|)
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.bfloat16: (2**-7, 1e-2)}
DIM = 37
LENGTHS = (1, 2, 17, 3, 30)
# name: (width, with bias, activation, weight [D, 1, W] (else [D, W]), packed documents (else a batch of 3 x 45))
CASES = {
    "w4-bias-silu-conv1d_weight": (4, True, "silu", True, False),
    "w3-plain": (3, False, None, False, False),
    "w2-bias-swish": (2, True, "swish", False, False),
    "w1-silu": (1, False, "silu", True, False),
    "w8-bias-silu": (8, True, "silu", False, False),
    "varlen-w4-bias-silu": (4, True, "silu", False, True),
    "varlen-w3-plain-conv1d_weight": (3, False, None, True, True),
    "varlen-w2-bias": (2, True, None, False, True),
}


def make_inputs(width, with_bias, conv1d_weight, varlen, dtype, seed=0, dim=DIM):
    """(x, weight, bias, cu_seqlens): x, weight, bias as leaves of `dtype` that require grad, cu_seqlens int32."""
    generator = torch.Generator().manual_seed(seed)
    batch, seq_len = (1, sum(LENGTHS)) if varlen else (3, 45)
    x = torch.randn(batch, seq_len, dim, generator=generator)
    weight = torch.randn(dim, 1, width, generator=generator) / width**0.5
    weight = weight if conv1d_weight else weight[:, 0].contiguous()
    bias = torch.randn(dim, generator=generator) if with_bias else None
    cu_seqlens = (
        torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32) if varlen else None
    )
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (x, weight, bias)]
    return (*leaves, cu_seqlens)


def outputs_and_grads(conv, x, weight, bias, activation, cu_seqlens, dy):
    y = conv(x, weight, bias, activation, cu_seqlens)
    leaves = [t for t in (x, weight, bias) if t is not None]
    return [y, *torch.autograd.grad(y, leaves, dy)]


def check_against_reference(width, with_bias, activation, conv1d_weight, varlen, dtype):
    x, weight, bias, cu_seqlens = make_inputs(width, with_bias, conv1d_weight, varlen, dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = outputs_and_grads(short_conv_triton, x, weight, bias, activation, cu_seqlens, dy)
    reference_leaves = [
        t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)
    ]
    expected = outputs_and_grads(short_conv_torch, *reference_leaves, activation, cu_seqlens, dy.double())
    rtol, atol = TOLERANCES[dtype]
    names = ["y", "dx", "dweight", "dbias"]
    for name, result, reference, like in zip(names, results, expected, [x, x, weight, bias]):
        assert result.dtype == like.dtype and result.shape == like.shape, name
        assert result.is_contiguous(), name
        torch.testing.assert_close(
            result.double(),
            reference,
            rtol=rtol,
            atol=atol * reference.abs().max().item(),
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("case", list(CASES))
def test_float32_matches_reference(case):
    check_against_reference(*CASES[case], torch.float32)


@pytest.mark.parametrize("case", ["w4-bias-silu-conv1d_weight", "varlen-w4-bias-silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_match_reference(case, dtype):
    check_against_reference(*CASES[case], dtype)


def test_float32_weight_with_bfloat16_x():
    """x and dy in bfloat16, weight and bias in float32: dweight and dbias come back in float32."""
    x, weight, bias, cu_seqlens = make_inputs(4, True, False, True, torch.float32)
    x = x.detach().to(torch.bfloat16).requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    results = outputs_and_grads(short_conv_triton, x, weight, bias, "silu", cu_seqlens, dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    expected = outputs_and_grads(short_conv_torch, *leaves, "silu", cu_seqlens, dy.double())
    assert [t.dtype for t in results] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    for name, result, reference in zip(["y", "dx", "dweight", "dbias"], results, expected):
        rtol = 2**-7 if result.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(result.double(), reference, rtol=rtol, atol=rtol * reference.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def test_backward_chunks_longer_than_the_shortest(monkeypatch):
    """A backward config with longer chunks than the shortest one (64 tokens here) writes fewer partial rows than
    the buffer holds; the sum reads exactly those."""
    monkeypatch.setattr(kernels._bwd_kernel, "configs", kernels._configs([(4, 16, 32, 1, 1)]))
    assert kernels.MIN_CHUNK < 64
    check_against_reference(*CASES["w4-bias-silu-conv1d_weight"], torch.float32)


def test_autotuning_is_keyed_on_rounded_token_counts(monkeypatch):
    """The kernels tune once per power-of-two bucket of B x T, not once per sequence length: text sampling grows the
    sequence one token per forward. Two configs make each autotuner choose; its timing (CUDA events) is replaced by
    a call of the kernel, so the interpreter runs every candidate."""

    def run_once(fn, quantiles):
        fn()
        return [1.0] * len(quantiles)

    tuners = [kernels._fwd_kernel, kernels._bwd_kernel]
    for tuner in tuners:
        monkeypatch.setattr(tuner, "configs", kernels._configs([(4, 8, 32, 1, 1), (2, 16, 32, 1, 1)]))
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setitem(tuner.__dict__, "do_bench", run_once)
    weight = torch.randn(8, 4, requires_grad=True)  # one channel block: the keys depend on B x T alone
    for batch, seq_len in ((1, 9), (2, 8), (1, 17), (3, 10)):
        x = torch.randn(batch, seq_len, 8, requires_grad=True)
        short_conv_triton(x, weight, None, "silu", None).sum().backward()
    # B x T = 9, 16, 17, 30: buckets 16 and 32.
    for tuner in tuners:
        assert [key[0] for key in tuner.cache] == [16, 32]
    # The backward reads the tuned config to size its partial sums: results stay exact with either config.
    check_against_reference(*CASES["w4-bias-silu-conv1d_weight"], torch.float32)


def test_empty_documents():
    """Empty documents (repeated cu_seqlens entries, also at both ends) change nothing."""
    x, weight, bias, cu_seqlens = make_inputs(4, True, False, True, torch.float32)
    with_empty = torch.tensor([0, 0, 1, 3, 3, 3, 20, 23, 53, 53], dtype=torch.int32)
    assert with_empty.unique().tolist() == cu_seqlens.tolist()
    result = short_conv_triton(x, weight, bias, "silu", with_empty)
    torch.testing.assert_close(result, short_conv_triton(x, weight, bias, "silu", cu_seqlens), rtol=0, atol=0)


def test_int64_cu_seqlens_and_strided_x():
    """cu_seqlens as int64, and x a slice of a wider tensor (row stride > D): the same results as int32 and a
    contiguous copy, bit for bit."""
    x, weight, bias, cu_seqlens = make_inputs(4, True, False, True, torch.float32)
    wide = torch.randn(1, x.shape[1], 2 * DIM)
    wide[..., 3 : 3 + DIM] = x.detach()
    strided = wide[..., 3 : 3 + DIM]
    assert not strided.is_contiguous()
    expected = short_conv_triton(x.detach(), weight.detach(), bias.detach(), "silu", cu_seqlens)
    result = short_conv_triton(strided, weight.detach(), bias.detach(), "silu", cu_seqlens.long())
    torch.testing.assert_close(result, expected, rtol=0, atol=0)


def test_backward_is_deterministic():
    x, weight, bias, cu_seqlens = make_inputs(4, True, False, True, torch.float32)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    first, second = (
        outputs_and_grads(short_conv_triton, x, weight, bias, "silu", cu_seqlens, dy) for _ in range(2)
    )
    torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.parametrize("conv1d_weight", [True, False], ids=["weight_d1w", "weight_dw"])
def test_custom_op_registration(conv1d_weight):
    """Schema, fake (meta) implementations (shapes, dtypes and strides of the real outputs) and the autograd
    registration of the forward op, and the fake implementation of the backward op, as torch.library checks them,
    for one convolution and for three run together."""
    x, weight, bias, cu_seqlens = make_inputs(3, True, conv1d_weight, True, torch.float32)
    checks = ("test_schema", "test_faketensor")
    one = (x, weight, bias, None, None, None, None, None, None)
    wide = make_inputs(3, True, conv1d_weight, True, torch.float32, seed=1, dim=2 * DIM + 3)
    three = (
        x,
        weight,
        bias,
        *wide[:3],
        *make_inputs(3, True, conv1d_weight, True, torch.float32, seed=2)[:3],
    )
    for members in (one, three):
        torch.library.opcheck(
            short_conv_fwd, (*members, "silu", cu_seqlens), test_utils=(*checks, "test_autograd_registration")
        )
        detached = [t.detach() if t is not None else None for t in members]
        dys = [torch.randn(t.shape) if t is not None else None for t in detached[0::3]]
        torch.library.opcheck(short_conv_bwd, (*dys, *detached, "silu", cu_seqlens), test_utils=checks)
    without_bias = [None if i % 3 == 2 else t for i, t in enumerate(detached)]
    torch.library.opcheck(short_conv_bwd, (*dys, *without_bias, None, None), test_utils=checks)


# name: (the members' channel counts, width, with bias, activation, packed documents)
GROUPS = {
    "three-odd-widths-bias-silu": ((DIM, DIM, 2 * DIM + 3), 4, True, "silu", False),
    "two-plain": ((DIM, 70), 3, False, None, False),
    "varlen-three-bias-silu": ((33, 65, 17), 4, True, "silu", True),
    "varlen-two-w2": ((DIM, 5), 2, False, "silu", True),
}


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convolutions_run_together_match_the_reference_and_each_alone(group, dtype):
    """One launch of each kernel over several inputs (grid axis 1 runs through the members' channel blocks, which
    end at different places) gives each member's y, dx, dweight and dbias as its own call does, bit for bit, and
    as the float64 reference does within the dtype's tolerance."""
    dims, width, with_bias, activation, varlen = GROUPS[group]
    members = [
        make_inputs(width, with_bias, i % 2 == 0, varlen, dtype, seed=i, dim=dim)[:3]
        for i, dim in enumerate(dims)
    ]
    cu_seqlens = make_inputs(width, with_bias, False, varlen, dtype)[3]
    dys = [torch.randn(x.shape, generator=torch.Generator().manual_seed(9 + i)).to(dtype)
           for i, (x, _, _) in enumerate(members)]  # fmt: skip
    leaves = [t for member in members for t in member if t is not None]
    together = short_conv_group_triton(members, activation, cu_seqlens)
    results = [*together, *torch.autograd.grad(together, leaves, dys)]
    alone = [short_conv_triton(*member, activation, cu_seqlens) for member in members]
    torch.testing.assert_close(results, [*alone, *torch.autograd.grad(alone, leaves, dys)], rtol=0, atol=0)
    reference_members = [[t.detach().double().requires_grad_() if t is not None else None for t in member]
                         for member in members]  # fmt: skip
    expected = [short_conv_torch(*member, activation, cu_seqlens) for member in reference_members]
    reference_leaves = [t for member in reference_members for t in member if t is not None]
    expected += torch.autograd.grad(expected, reference_leaves, [dy.double() for dy in dys])
    rtol, atol = TOLERANCES[dtype]
    for result, reference in zip(results, expected, strict=True):
        torch.testing.assert_close(
            result.double(), reference, rtol=rtol, atol=atol * reference.abs().max().item()
        )


def test_convolutions_run_together_must_agree():
    x, weight, bias, _ = make_inputs(4, True, False, False, torch.float32)
    short = make_inputs(4, True, False, False, torch.float32)[0][:, :40]
    narrow = make_inputs(3, True, False, False, torch.float32)[1]
    for members in (
        [(x, weight, bias), (short, weight, bias)],
        [(x, weight, bias), (x, narrow, bias)],
        [(x, weight, bias), (x, weight, None)],
        [(x, weight, bias), (x.double(), weight, bias)],
    ):
        with pytest.raises(ValueError, match="run together must share"):
            short_conv_group_triton(members, "silu", None)
    with pytest.raises(ValueError, match="1 to 3 convolutions"):
        short_conv_group_triton([(x, weight, bias)] * 4, "silu", None)


def test_compiled_graph_equals_eager():
    """torch.compile(fullgraph=True) traces the op as one node; output and gradients equal eager bit for bit
    (aot_eager here, on the CPU)."""
    x, weight, bias, cu_seqlens = make_inputs(4, True, False, True, torch.float32)

    def loss(x, weight, bias):
        return short_conv_triton(x * 1.5, weight, bias, "silu", cu_seqlens).square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        value = fn(x, weight, bias)
        results.append((value, *torch.autograd.grad(value, (x, weight, bias))))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_refuses_unsupported_arguments():
    x = torch.zeros(2, 5, 4)
    with pytest.raises(ValueError, match="activation must be one of"):
        short_conv_triton(x, torch.zeros(4, 3), None, "relu", None)
    with pytest.raises(ValueError, match="widths 1 to 8, got 9"):
        short_conv_triton(x, torch.zeros(4, 9), None, None, None)
    with pytest.raises(ValueError, match="expected x \\[B, T, D\\] and weight \\[D, W\\]"):
        short_conv_triton(x, torch.zeros(5, 3), None, None, None)
    with pytest.raises(ValueError, match="bias must be \\[D\\]"):
        short_conv_triton(x, torch.zeros(4, 3), torch.zeros(3), None, None)
    with pytest.raises(ValueError, match="batch size 1"):
        short_conv_triton(x, torch.zeros(4, 3), None, None, torch.tensor([0, 5]))
