"""Shared test helpers for the ops tests."""

import torch

from flame.ops.attention import SOFTPICK_EPS, visibility_mask


def projection_grads(outputs, inputs, seed=0):
    """Gradients of sum_i <outputs[i], R_i> w.r.t. inputs, R_i fixed random tensors (same seed -> same R_i)."""
    generator = torch.Generator().manual_seed(seed)
    loss = sum(
        (out * torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.dtype)).sum()
        for out in outputs
    )
    return torch.autograd.grad(loss, inputs)


def assert_all_close(actual, expected, rtol, atol, names=None):
    """torch.testing.assert_close over two sequences of tensors, naming the failing pair."""
    assert len(actual) == len(expected)
    names = names or [str(i) for i in range(len(actual))]
    for name, a, e in zip(names, actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def softpick_reference_lse(q, k, variant, window_size, cu_seqlens, scale):
    """[B, H, T] float64: the per-row statistic flame's softpick kernel saves (softpick_triton's module docstring):
    m + log(sum |e^(s-m) - e^-m| + eps) for softpick, logsumexp of the non-negative scores for rectified (+inf for
    a row without one)."""
    seq_len, group = q.shape[1], q.shape[2] // k.shape[2]
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(group, 2)) * scale
    visible = visibility_mask(seq_len, True, window_size, cu_seqlens, q.device)
    if variant == "softpick":
        x = torch.where(visible, scores, 0.0)
        shift = x.amax(-1, keepdim=True).clamp(min=0)
        total = (torch.exp(x - shift) - torch.exp(-shift)).abs().sum(-1) + SOFTPICK_EPS
        return shift[..., 0] + total.log()
    lse = torch.logsumexp(torch.where(visible & (scores >= 0), scores, float("-inf")), -1)
    return torch.where(torch.isneginf(lse), float("inf"), lse)
