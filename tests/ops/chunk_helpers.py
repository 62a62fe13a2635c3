"""What the tests of flame's sequential chunk recurrences share (fwd_h, fwd_o and dhu; under Triton's interpreter
and on the GPU): their cases and limits, a token-local cumulative log2-decay, float64 copies of a call's arguments,
the relative RMS error, a case's sequences, whether a launch setting fits it, and the comparisons of results."""

import math

import torch

from flame.ops.gated_delta_rule.chunk_recurrence import key_block, shared_memory_limit
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


def gpu_layout(lengths: tuple) -> tuple[int, int, torch.Tensor | None, int]:
    """(batch, seq_len, cu_seqlens on the GPU or None, sequences) of a GPU case's lengths: (batch, seq_len), or
    (1, length, length, ...) for packed documents."""
    if len(lengths) == 2:
        return *lengths, None, lengths[0]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths[1:]).cumsum(0).tolist()], device="cuda")
    return 1, sum(lengths[1:]), cu_seqlens, len(lengths) - 1


def fits(fitting_configs, case, dtype, config) -> bool:
    """Whether a kernel's launch setting fits a GPU case (its K and state layout) in this GPU's shared memory, by
    the kernel's bound (``fitting_configs``)."""
    key_dim, state_v_first = case[0], case[5]
    element_size = torch.tensor([], dtype=dtype).element_size()
    return config in fitting_configs(
        key_block(key_dim), 64, element_size, state_v_first, shared_memory_limit(0)
    )


def assert_close(names, results, expected, limit: float) -> None:
    """Each result absent where the expected one is, else of its shape and within ``limit`` of it (rms_ratio)."""
    for name, got, want in zip(names, results, expected, strict=True):
        if want is None:
            assert got is None, name
            continue
        assert got.shape == want.shape, name
        assert rms_ratio(want, got) < limit, f"{name}: {rms_ratio(want, got):.2e}"


def interpreted_layout(lengths: tuple) -> tuple[int, int, torch.Tensor | None, int]:
    """(batch, seq_len, cu_seqlens or None, sequences) of an interpreted case's lengths: two equal ones are a batch
    of two rows, any other tuple packed documents."""
    if len(lengths) == 2:
        return 2, lengths[0], None, 2
    return 1, sum(lengths), torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), len(lengths)


def packed_chunk_indices(lengths: tuple, chunk_size: int) -> torch.Tensor:
    """FLA's chunk_indices of packed documents: (sequence, chunk within it) per chunk, as its functions pass them."""
    return torch.tensor([(n, c) for n, length in enumerate(lengths) for c in range(-(-length // chunk_size))])


def settings(configs: list) -> list[tuple[int, int, int]]:
    """(BV, warps, stages) of each launch setting."""
    return [(c.kwargs["BV"], c.num_warps, c.num_stages) for c in configs]


def assert_float32_close(names, results, expected, limit: float = 1e-5) -> None:
    """Each result absent where the expected one is, else float32, of its shape and within ``limit`` of its largest
    value at every element."""
    for name, got, want in zip(names, results, expected, strict=True):
        if want is None:
            assert got is None, name
            continue
        assert got.shape == want.shape and got.dtype == torch.float32, name
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < limit, f"{name}: max error {err:.2e} of the largest value"
