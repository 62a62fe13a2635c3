"""What the tests of flame's sequential chunk recurrences share (fwd_h, fwd_o and dhu; under Triton's interpreter
and on the GPU): a token-local cumulative log2-decay, float64 copies of a call's arguments, the relative RMS
error."""

import math

import torch

from flame.ops.gated_delta_rule.dqkwg_triton import chunk_bounds


def chunk_local_decay(batch, seq_len, heads, chunk_size, cu_seqlens, device, rate=1.0) -> torch.Tensor:
    """FLA's g [B, T, heads]: a log2-decay of up to ``rate`` nats per token, cumulated within each chunk."""
    starts, ends = chunk_bounds(batch, seq_len, chunk_size, cu_seqlens, torch.device(device))
    raw = -torch.rand(batch * seq_len, heads, device=device) * rate / math.log(2)
    g = torch.zeros_like(raw)
    for start, end in zip(starts.tolist(), ends.tolist()):
        g[start:end] = raw[start:end].cumsum(0)
    return g.view(batch, seq_len, heads)


def as_float64(arguments: dict) -> dict:
    """The arguments with their floating-point tensors in float64 (a reference's call)."""
    return {
        name: x.double() if torch.is_tensor(x) and x.is_floating_point() else x
        for name, x in arguments.items()
    }


def rms_ratio(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, in float64."""
    ref, out = ref.double(), out.double()
    return ((ref - out).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-30)).item()
