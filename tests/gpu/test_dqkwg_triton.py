"""flame's Triton chunk_bwd_dqkwg on the GPU against the PyTorch one (float64 on the same inputs).

bf16 inputs (training) and float32 (no TF32: exact products, ``exact_float32``), head sizes of the seed configs (K 64/128/256, V up
to 512), both state layouts, with and without dw, grouped value heads and varlen. Limits on the relative RMS error
||x - ref|| / ||ref||: 1e-5 in float32, 0.01 in bf16 (the products take bf16 inputs, and dq/dk/dw are stored in
bf16 as FLA stores them).
"""

import math

import pytest
import torch

from flame.ops.gated_delta_rule.dqkwg_reference import chunk_bwd_dqkwg_torch
from flame.ops.gated_delta_rule.dqkwg_triton import (
    BLOCK_K,
    TUNING_CONFIGS,
    chunk_bounds,
    chunk_bwd_dqkwg_triton,
)

# float32 products in IEEE float32: the kernel multiplies float32 as Triton's default says, as FLA's kernels do.
pytestmark = pytest.mark.usefixtures("exact_float32")
LIMITS = {torch.float32: 1e-5, torch.bfloat16: 0.01}
CASES = [
    # K, V, heads, value heads, lengths (several = varlen), state_v_first, with w
    (64, 64, 4, 4, (2, 300), False, True),
    (128, 128, 2, 4, (2, 257), True, True),
    (256, 512, 6, 6, (2, 200), True, True),
    (256, 512, 2, 2, (1, 63, 200, 37), True, False),
    (128, 256, 2, 4, (1, 100, 300, 129, 48), False, True),
]


def rms_ratio(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((ref - out).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-30)).item()


# The case matrix runs one launch setting (each setting compiles per shape); the autotuned path and every tuning
# setting run on the 340M model's shape below.
PINNED = {"BK": BLOCK_K, "BV": 64, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("key_dim", "value_dim", "heads", "v_heads", "shape", "v_first", "with_w"), CASES)
def test_kernel_matches_pytorch(key_dim, value_dim, heads, v_heads, shape, v_first, with_w, dtype):
    check(key_dim, value_dim, heads, v_heads, shape, v_first, with_w, dtype, PINNED)


@pytest.mark.parametrize(
    "launch",
    [None]
    + [
        {"BK": BLOCK_K, **c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        for c in TUNING_CONFIGS
    ],
    ids=["autotuned"] + [f"config{i}" for i in range(len(TUNING_CONFIGS))],
)
def test_every_launch_setting(launch):
    check(*CASES[2], torch.bfloat16, launch)


def check(
    key_dim,
    value_dim,
    heads,
    v_heads,
    shape,
    v_first,
    with_w,
    dtype,
    launch,
    kernel=None,
    dh_dtype=torch.float32,
):
    """One case against the float64 reference: flame's Triton kernel with ``launch``, or ``kernel`` (the same
    arguments as chunk_bwd_dqkwg_torch) with the state's gradient in ``dh_dtype``."""
    torch.manual_seed(0)
    dev, chunk = "cuda", 64
    varlen = shape[0] == 1 and len(shape) > 2
    lengths = shape[1:]
    batch, seq_len = (1, sum(lengths)) if varlen else (shape[0], lengths[0])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev) if varlen else None
    starts, ends = chunk_bounds(batch, seq_len, chunk, cu, torch.device(dev))
    q = torch.randn(batch, seq_len, heads, key_dim, device=dev).to(dtype)
    k = torch.randn(batch, seq_len, heads, key_dim, device=dev).to(dtype) / math.sqrt(key_dim)
    v = torch.randn(batch, seq_len, v_heads, value_dim, device=dev).to(dtype)
    w = torch.randn(batch, seq_len, v_heads, key_dim, device=dev).to(dtype) if with_w else None
    g = torch.empty(batch * seq_len, v_heads, device=dev)
    for start, end in zip(starts.tolist(), ends.tolist()):
        g[start:end] = (-torch.rand(end - start, v_heads, device=dev) * 0.2).cumsum(0)
    g = g.view(batch, seq_len, v_heads)
    state = (value_dim, key_dim) if v_first else (key_dim, value_dim)
    h = torch.randn(1, len(starts), v_heads, *state, device=dev).to(dtype)
    dh = torch.randn(1, len(starts), v_heads, *state, device=dev).to(dh_dtype)
    do = torch.randn_like(v)
    dv = torch.randn_like(v) if with_w else None
    kwargs = dict(
        w=w, g=g, dv=dv, scale=key_dim**-0.5, state_v_first=v_first, cu_seqlens=cu, chunk_size=chunk
    )

    def f64(x):
        return x.double() if torch.is_tensor(x) and x.is_floating_point() else x

    expected = chunk_bwd_dqkwg_torch(
        *map(f64, (q, k, v, do, h, dh)), **{n: f64(x) for n, x in kwargs.items()}
    )
    if kernel is None:
        result = chunk_bwd_dqkwg_triton(q, k, v, do, h, dh, **kwargs, launch=launch)
    else:
        result = kernel(q, k, v, do, h, dh, **kwargs)
    ratios = {}
    for name, got, want in zip(("dq", "dk", "dw", "dg"), result, expected):
        if want is None:
            assert got is None
            continue
        assert torch.isfinite(got).all(), name
        ratios[name] = rms_ratio(want, got)
    print(f"K{key_dim} V{value_dim} {str(dtype)[6:]}: " + " ".join(f"{n} {r:.2e}" for n, r in ratios.items()))
    assert max(ratios.values()) < LIMITS[dtype], ratios
