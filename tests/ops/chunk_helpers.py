"""What the tests of flame's sequential chunk recurrences share (fwd_h, fwd_o and dhu; under Triton's interpreter
and on the GPU): their cases and limits, a token-local cumulative log2-decay, float64 copies of a call's arguments,
the relative RMS error."""

import math

import torch

from flame.ops.gated_delta_rule.dqkwg_triton import chunk_bounds

# Under Triton's interpreter: float32 inputs, chunks of 16, odd lengths (two equal ones: a batch; otherwise packed),
# grouped value heads, both state layouts, with and without the gate and the states.
INTERPRETED_ARGUMENTS = ("lengths", "num_heads", "num_v_heads", "key_dim", "value_dim", "state_v_first", "gated",
                         "states")  # fmt: skip
INTERPRETED_CASES = [
    ((37, 37), 2, 2, 20, 24, False, True, True),
    ((45,), 1, 3, 32, 17, True, True, False),
    ((19, 40, 5), 2, 4, 40, 33, True, True, True),
    ((29, 29), 1, 1, 16, 40, False, False, True),
]
# On the GPU: the seed configs' head sizes, chunks of 64.
GPU_CASES = [
    # K, V, heads, value heads, lengths (several = varlen), state_v_first, gated, states
    (64, 64, 4, 4, (2, 300), False, True, False),
    (128, 128, 2, 4, (2, 257), True, True, True),
    (256, 512, 6, 6, (2, 200), False, True, False),
    (256, 512, 2, 2, (1, 63, 200, 37), True, True, True),
    (96, 192, 4, 4, (2, 130), False, False, True),
]
# Limits on the GPU tests' relative RMS error per input dtype: exact float32 products, or bf16 intermediates
GPU_LIMITS = {torch.float32: 1e-5, torch.bfloat16: 0.01}


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
