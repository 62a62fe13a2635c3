"""flame's Triton short-conv kernels (flame/ops/short_conv/triton_kernel.py) on the GPU, against the PyTorch reference
`short_conv_torch` in float64 on the same (rounded) inputs, and against FLA 0.6.0's `causal_conv1d`.

Odd sizes (D = 333 and 1000, T up to 1000, packed documents of lengths 1 to 700, some shorter than the kernel),
widths 2 to 4, with and without bias and SiLU, weights [D, W] and [D, 1, W], and the realistic size x [2, 2048,
1536] (W = 4, bias, SiLU). Outputs and the gradients dx, dweight, dbias of one fixed output gradient are compared
with torch.testing.assert_close, with the limits of the CPU interpreter tests (whose docstring says why), atol
relative to the largest |reference value| of each tensor: float32 rtol = 1e-5, atol = 1e-5 x max |reference| (the
kernel's sigmoid is approximate, 2 ulp, far inside that), bfloat16 rtol = 2^-7, atol = 1e-2 x max |reference|.
Against FLA (bfloat16, same inputs): relative RMS difference ||ours - FLA|| / ||FLA|| <= 1e-2 (both round to
bfloat16; FLA's kernel sums in another order; measured 1.1e-3 to 1.4e-3 for the gradients, 0 for y). The main
matrix pins each kernel to its first autotuning candidate; test_every_configuration runs every candidate.
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

DEVICE = "cuda"
# dtype: (rtol, atol relative to the largest |reference value|)
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-2)}
FLA_LIMIT = 1e-2
KERNELS = (kernels._fwd_kernel, kernels._bwd_kernel)
# name: (batch, seq_len, dim, width, with bias, activation, weight [D, 1, W] (else [D, W]), document lengths)
CASES = {
    "batch-w4-bias-silu": (3, 777, 333, 4, True, "silu", True, None),
    "batch-w3-plain": (2, 1000, 1000, 3, False, None, False, None),
    "varlen-w4-bias-silu": (1, 1024, 333, 4, True, "silu", False, (1, 300, 2, 700, 3, 18)),
    "varlen-w2-silu": (1, 1000, 1000, 2, False, "silu", True, (500, 1, 499)),
    "realistic": (2, 2048, 1536, 4, True, "silu", False, None),
}


def pin_configs(monkeypatch, index=0):
    """Each autotuned kernel runs only its index-th candidate (wrapping around)."""
    for kernel in KERNELS:
        monkeypatch.setattr(kernel, "configs", [kernel.configs[index % len(kernel.configs)]])


def make_inputs(case, dtype, seed=0):
    """(x, weight, bias, cu_seqlens, dy), x / weight / bias as leaves of `dtype` that require grad."""
    batch, seq_len, dim, width, with_bias, _, conv1d_weight, lengths = CASES[case]
    generator = torch.Generator(DEVICE).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=DEVICE, generator=generator)).to(dtype)

    x = randn(batch, seq_len, dim).requires_grad_()
    weight = (
        randn(dim, 1, width, scale=width**-0.5) if conv1d_weight else randn(dim, width, scale=width**-0.5)
    )
    bias = randn(dim).requires_grad_() if with_bias else None
    cu_seqlens = None
    if lengths is not None:
        assert sum(lengths) == seq_len
        cu_seqlens = torch.tensor(
            [0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32
        )
    return x, weight.requires_grad_(), bias, cu_seqlens, randn(batch, seq_len, dim)


def outputs_and_grads(conv, x, weight, bias, activation, cu_seqlens, dy):
    y = conv(x, weight, bias, activation, cu_seqlens)
    leaves = [t for t in (x, weight, bias) if t is not None]
    return [y, *torch.autograd.grad(y, leaves, dy)]


def check_against_reference(case, dtype):
    x, weight, bias, cu_seqlens, dy = make_inputs(case, dtype)
    activation = CASES[case][5]
    results = outputs_and_grads(short_conv_triton, x, weight, bias, activation, cu_seqlens, dy)
    reference_leaves = [
        t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)
    ]
    expected = outputs_and_grads(short_conv_torch, *reference_leaves, activation, cu_seqlens, dy.double())
    rtol, atol = TOLERANCES[dtype]
    names = ["y", "dx", "dweight", "dbias"]
    for name, result, reference, like in zip(names, results, expected, [x, x, weight, bias]):
        assert result.dtype == like.dtype and result.shape == like.shape and result.is_contiguous(), name
        torch.testing.assert_close(
            result.double(),
            reference,
            rtol=rtol,
            atol=atol * reference.abs().max().item(),
            msg=lambda m, name=name: f"{case} {name}: {m}",
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(monkeypatch, case, dtype):
    pin_configs(monkeypatch)
    check_against_reference(case, dtype)


@pytest.mark.parametrize("index", range(max(len(kernel.configs) for kernel in KERNELS)))
def test_every_configuration(monkeypatch, index):
    pin_configs(monkeypatch, index)
    for case in ("batch-w4-bias-silu", "varlen-w4-bias-silu"):
        check_against_reference(case, torch.bfloat16)


def relative_rms(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference, value = reference.double(), value.double()
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("case", ["realistic", "varlen-w4-bias-silu", "batch-w3-plain"])
def test_matches_fla_causal_conv1d(case):
    from fla.modules.causal_conv1d import causal_conv1d

    x, weight, bias, cu_seqlens, dy = make_inputs(case, torch.bfloat16)
    activation = CASES[case][5]

    def fla(x, weight, bias, activation, cu_seqlens):
        taps = weight[:, 0] if weight.ndim == 3 else weight
        return causal_conv1d(x=x, weight=taps, bias=bias, activation=activation, cu_seqlens=cu_seqlens)[0]

    ours = outputs_and_grads(short_conv_triton, x, weight, bias, activation, cu_seqlens, dy)
    theirs = outputs_and_grads(fla, x, weight, bias, activation, cu_seqlens, dy)
    for name, a, b in zip(["y", "dx", "dweight", "dbias"], ours, theirs):
        print(f"{case} {name}: relative RMS difference to FLA {relative_rms(a, b):.2e}")
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert relative_rms(a, b) <= FLA_LIMIT, name


def test_backward_is_deterministic():
    x, weight, bias, cu_seqlens, dy = make_inputs("realistic", torch.bfloat16)
    first, second = (
        outputs_and_grads(short_conv_triton, x, weight, bias, "silu", cu_seqlens, dy) for _ in range(2)
    )
    torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["batch-w4-bias-silu", "varlen-w2-silu"])
def test_ops_pass_opcheck(case):
    """Schema, fake implementations against the real outputs, autograd registration and AOT dispatch (dynamic
    shapes) of the forward op (the backward op runs inside the autograd checks), and the backward op's own, for one
    convolution and for three run together. The kernels are deterministic; float32 inputs."""
    x, weight, bias, cu_seqlens, dy = make_inputs(case, torch.float32)
    activation = CASES[case][5]
    second, third = (make_inputs(case, torch.float32, seed=seed)[:3] for seed in (1, 2))
    for members in (
        (x, weight, bias, None, None, None, None, None, None),
        (x, weight, bias, *second, *third),
    ):
        torch.library.opcheck(short_conv_fwd, (*members, activation, cu_seqlens), rtol=1e-5, atol=1e-5)
        detached = [t.detach() if t is not None else None for t in members]
        dys = [torch.randn_like(t) if t is not None else None for t in detached[0::3]]
        torch.library.opcheck(short_conv_bwd, (*dys, *detached, activation, cu_seqlens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_gated_deltanets_q_k_v_together_equal_each_alone(monkeypatch, varlen):
    """gated_deltanet_340M's q, k and v convolutions (1536, 1536 and 3072 channels, W = 4, SiLU, no bias, bf16) in
    one launch of each kernel: y, dx and dweight bit for bit as three calls with the same launch setting give them
    (the autotuner keys the group apart from its members, and another chunk length sums dweight in another
    order), and within the bf16 tolerance of the float64 reference."""
    pin_configs(monkeypatch)
    generator = torch.Generator(DEVICE).manual_seed(5)
    batch, seq_len = (1, 4096) if varlen else (2, 2048)
    cu_seqlens = torch.tensor([0, 1, 1000, 1003, 4096], device=DEVICE, dtype=torch.int32) if varlen else None
    members = [
        (
            torch.randn(batch, seq_len, dim, device=DEVICE, generator=generator).bfloat16().requires_grad_(),
            (torch.randn(dim, 1, 4, device=DEVICE, generator=generator) / 2).bfloat16().requires_grad_(),
            None,
        )
        for dim in (1536, 1536, 3072)
    ]
    dys = [torch.randn(x.shape, device=DEVICE, generator=generator).bfloat16() for x, _, _ in members]
    leaves = [t for x, weight, _ in members for t in (x, weight)]
    together = short_conv_group_triton(members, "silu", cu_seqlens)
    alone = [short_conv_triton(*member, "silu", cu_seqlens) for member in members]
    results = [*together, *torch.autograd.grad(together, leaves, dys)]
    torch.testing.assert_close(results, [*alone, *torch.autograd.grad(alone, leaves, dys)], rtol=0, atol=0)
    reference = [[t.detach().double().requires_grad_() for t in (x, weight)] for x, weight, _ in members]
    expected = [short_conv_torch(x, weight, None, "silu", cu_seqlens) for x, weight in reference]
    expected += torch.autograd.grad(
        expected, [t for pair in reference for t in pair], [dy.double() for dy in dys]
    )
    rtol, atol = TOLERANCES[torch.bfloat16]
    for result, value in zip(results, expected, strict=True):
        torch.testing.assert_close(result.double(), value, rtol=rtol, atol=atol * value.abs().max().item())


def test_compiled_graph_equals_eager():
    """torch.compile(fullgraph=True) (inductor) keeps the op as one node, with the eager output and gradients."""
    x, weight, bias, cu_seqlens, _ = make_inputs("varlen-w4-bias-silu", torch.bfloat16)

    def loss(x, weight, bias):
        return short_conv_triton(x * 2, weight, bias, "silu", cu_seqlens).float().square().sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        value = fn(x, weight, bias)
        results.append((value, *torch.autograd.grad(value, (x, weight, bias))))
    torch.testing.assert_close(results[1], results[0], rtol=1e-3, atol=1e-3)
