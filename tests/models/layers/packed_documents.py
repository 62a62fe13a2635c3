"""A layer given documents packed into one row (cu_seqlens) against the same layer run on each document alone."""

import torch

LENGTHS = [11, 1, 25]  # one document of a single token, one past a 16-token chunk
BOUNDS = torch.tensor([0, 11, 12, 37], dtype=torch.int32)


def assert_packed_equals_alone(layer: torch.nn.Module, width: int, limit: float) -> None:
    """Output, input gradient and every parameter's gradient within ``limit`` of the largest value, float64 inputs;
    the row read as one document differs past its first document (the boundaries cut)."""
    hidden = torch.randn(1, sum(LENGTHS), width, dtype=torch.float64)
    grad = torch.randn(1, sum(LENGTHS), width, dtype=torch.float64)

    def packed(h):
        return layer(h, cu_seqlens=BOUNDS)[0]

    def alone(h):
        return torch.cat([layer(document)[0] for document in h.split(LENGTHS, dim=1)], dim=1)

    results = []
    for forward in (packed, alone):
        layer.zero_grad()
        leaf = hidden.clone().requires_grad_()
        out = forward(leaf)
        out.backward(grad)
        results.append((out, leaf.grad, *(p.grad.clone() for p in layer.parameters())))
    names = ("output", "input", *(n for n, _ in layer.named_parameters()))
    for name, got, reference in zip(names, *results, strict=True):
        difference = (got - reference).abs().max() / reference.abs().max()
        assert difference <= limit, f"{name}: {difference:.1e} of the largest value"
    whole = layer(hidden)[0]
    assert (whole[:, LENGTHS[0] :] - results[0][0][:, LENGTHS[0] :]).abs().max() > 1e-3
