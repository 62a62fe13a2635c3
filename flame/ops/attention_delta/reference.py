"""The definition of the attention backward's delta in PyTorch, on any device."""

import torch


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision delta is summed and returned in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_delta_torch(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """o, do [..., V] -> delta [...] = sum over V of o * do, each product and the sum in sum_dtype."""
    dtype = sum_dtype(o.dtype)
    return (o.to(dtype) * do.to(dtype)).sum(-1)
