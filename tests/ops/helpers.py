"""Shared test helpers for the ops tests."""

import torch


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
