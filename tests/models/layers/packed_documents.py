"""A layer given documents packed into one row (cu_seqlens) against the same layer run on each document alone."""

import torch

LENGTHS = [11, 1, 25]  # one document of a single token, one past a 16-token chunk
BOUNDS = torch.tensor([0, 11, 12, 37], dtype=torch.int32)


def assert_packed_equals_alone(
    layer: torch.nn.Module, width: int, limit: float, reference: torch.nn.Module | None = None
) -> None:
    """Output, input gradient and every parameter's gradient within ``limit`` of the largest value, float64 inputs
    rounded to ``layer``'s dtype on its device; the documents alone run through ``reference`` (a float64 copy of
    ``layer`` on the CPU; default ``layer`` itself). The row read as one document differs past its first document
    (the boundaries cut)."""
    reference = layer if reference is None else reference
    weight = next(layer.parameters())
    hidden = torch.randn(1, sum(LENGTHS), width, dtype=torch.float64)
    grad = torch.randn(1, sum(LENGTHS), width, dtype=torch.float64)

    def packed(h):
        return layer(h, cu_seqlens=BOUNDS.to(weight.device))[0]

    def alone(h):
        return torch.cat([reference(document)[0] for document in h.split(LENGTHS, dim=1)], dim=1)

    results = []
    for forward, module, device, dtype in (
        (packed, layer, weight.device, weight.dtype),
        (alone, reference, "cpu", torch.float64),
    ):
        module.zero_grad()
        leaf = hidden.to(device, dtype).requires_grad_()
        out = forward(leaf)
        out.backward(grad.to(device, dtype))
        tensors = (out, leaf.grad, *(p.grad for p in module.parameters()))
        results.append([t.detach().double().cpu() for t in tensors])
    names = ("output", "input", *(n for n, _ in layer.named_parameters()))
    for name, got, expected in zip(names, *results, strict=True):
        difference = (got - expected).abs().max() / expected.abs().max()
        assert difference <= limit, f"{name}: {difference:.1e} of the largest value"
    with torch.no_grad():
        whole = reference(hidden)[0]
    assert (whole[:, LENGTHS[0] :] - results[0][0][:, LENGTHS[0] :]).abs().max() > 1e-3
