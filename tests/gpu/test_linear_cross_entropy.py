"""The fused linear cross-entropy's CUDA backends (flame/ops/linear_cross_entropy.py): Liger-Kernel's Triton kernel
("liger", where the liger extra is installed), flame's chunked PyTorch code ("torch") and FLA 0.6.0's Triton kernel
("fla"), against the unfused loss (the logits, then flame/loss.py's
loss_sums) on the same inputs: 1037 tokens x vocabulary 5003 x hidden 256, a tenth of the labels ignored, chunks of
100 tokens (FLA rounds them up to 128).
float32 (TF32 off): loss rtol 1e-5, gradients rtol = 1e-4, atol = 1e-4 x max |reference|. bfloat16: both paths
round the logits (and the logit gradients) to bfloat16, in other matmul kernels and orders, so the loss within
rtol 1e-3 and the gradients within a relative RMS difference ||fused - unfused|| / ||unfused|| <= 1e-2."""

import pytest
import torch

from flame.loss import IGNORE_INDEX, loss_sums
from flame.ops import dispatch
from flame.ops.linear_cross_entropy import linear_cross_entropy

TOKENS, VOCAB, HIDDEN, CHUNK = 1037, 5003, 256, 100


@pytest.fixture
def backend(request):
    if request.param == "liger":
        pytest.importorskip("liger_kernel")
    dispatch.pin("linear_cross_entropy", request.param)
    yield request.param
    dispatch.pin("linear_cross_entropy", None)


def inputs(dtype):
    generator = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=generator).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=generator) / HIDDEN**0.5).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=generator)
    labels[torch.rand(TOKENS, device="cuda", generator=generator) < 0.1] = IGNORE_INDEX
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def unfused(hidden, weight, labels, z_loss):
    cross_entropy, z_term = loss_sums(hidden @ weight.T, labels, z_loss=z_loss > 0)
    loss = cross_entropy + z_loss * z_term
    return loss, torch.autograd.grad(loss, (hidden, weight))


def relative_rms(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("backend", ["liger", "torch", "fla"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_backend_matches_the_unfused_loss(backend, dtype, z_loss):
    hidden, weight, labels = inputs(dtype)
    loss, grads = unfused(hidden, weight, labels, z_loss)
    fused_loss, cross_entropy, z_term = linear_cross_entropy(
        hidden, weight, labels, IGNORE_INDEX, z_loss, CHUNK
    )
    fused_grads = torch.autograd.grad(fused_loss, (hidden, weight))
    if backend != "fla" or z_loss == 0:  # FLA refuses the z-loss: the PyTorch code served the call
        want_cross_entropy, want_z_term = loss_sums((hidden @ weight.T).detach(), labels, z_loss=z_loss > 0)
        torch.testing.assert_close(cross_entropy.float(), want_cross_entropy.float(), rtol=1e-3, atol=0)
        torch.testing.assert_close(z_term.float(), want_z_term.float(), rtol=1e-2, atol=1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=0)
        for actual, expected in zip(fused_grads, grads):
            atol = 1e-4 * expected.abs().max().item()
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=atol)
    else:
        torch.testing.assert_close(fused_loss, loss, rtol=1e-3, atol=0)
        for actual, expected in zip(fused_grads, grads):
            assert actual.dtype == torch.bfloat16
            assert relative_rms(actual, expected) <= 1e-2


def test_fla_backend_takes_the_pytorch_path_for_z_loss():
    hidden, weight, labels = inputs(torch.bfloat16)
    results = []
    for backend in ("torch", "fla"):
        dispatch.pin("linear_cross_entropy", backend)
        loss = linear_cross_entropy(hidden, weight, labels, IGNORE_INDEX, 1e-3, CHUNK)[0]
        results.append((loss, *torch.autograd.grad(loss, (hidden, weight))))
    dispatch.pin("linear_cross_entropy", None)
    for a, b in zip(*results):
        assert torch.equal(a, b)
