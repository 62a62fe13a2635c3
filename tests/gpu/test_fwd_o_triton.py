"""flame's Triton kernel of the forward's state recurrence and output in one pass, on the GPU, against the PyTorch
references (float64 on the same inputs) and against FLA's ``chunk_gated_delta_rule_fwd_h`` followed by its
``chunk_fwd_o``, whose o and final state it must equal for the same call.

bf16 inputs (training) and float32 (exact products, ``exact_float32``), the seed configs' head sizes (K 64/128/256,
V up to 512), both state layouts, gated and plain, the initial and the final state, grouped value heads and varlen.
Limits on the relative RMS error ||x - ref|| / ||ref||: 1e-5 in float32, 0.01 in bf16 (h and v_new enter the
products rounded to bf16, as FLA stores them).
"""

import math

import pytest
import torch

from flame.ops.gated_delta_rule.fwd_o_reference import chunk_fwd_ho_torch
from flame.ops.gated_delta_rule.fwd_o_triton import (
    TUNING_CONFIGS,
    chunk_fwd_o_triton,
    fitting_configs,
    serves,
)
from tests.ops.chunk_helpers import (
    GPU_CASES,
    GPU_LIMITS,
    as_float64,
    assert_close,
    chunk_local_decay,
    fits,
    gpu_layout,
)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("exact_float32"),
]
PINNED = {"BV": 64, "num_warps": 8, "num_stages": 1}  # the setting that fits every case


def inputs(key_dim, value_dim, heads, v_heads, shape, v_first, gated, states, dtype):
    torch.manual_seed(0)
    batch, seq_len, cu_seqlens, sequences = gpu_layout(shape)
    device = torch.device("cuda")
    q = torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, key_dim, device=device), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, key_dim, device=device), dim=-1)
    w = torch.randn(batch, seq_len, v_heads, key_dim, device=device) / math.sqrt(key_dim)
    u = torch.randn(batch, seq_len, v_heads, value_dim, device=device)
    g = None
    if gated:
        g = chunk_local_decay(batch, seq_len, v_heads, 64, cu_seqlens, device, rate=0.1)
    state = (value_dim, key_dim) if v_first else (key_dim, value_dim)
    h0 = torch.randn(sequences, v_heads, *state, device=device) if states else None
    tensors = [x.to(dtype) for x in (q, k, w, u)]
    return tensors, dict(
        g=g,
        scale=key_dim**-0.5,
        initial_state=h0,
        output_final_state=states,
        state_v_first=v_first,
        cu_seqlens=cu_seqlens,
    )


def check(case, dtype, launch):
    tensors, args = inputs(*case, dtype)
    result = chunk_fwd_o_triton(*tensors, **args, launch=launch)
    expected = chunk_fwd_ho_torch(*(x.double() for x in tensors),
                                  **as_float64(args))  # fmt: skip
    assert_close(("o", "final state"), result, expected, GPU_LIMITS[dtype])
    return tensors, args, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_matches_pytorch(case, dtype):
    """Autotuned over the settings that fit; where none does (float32 at K 256), the kernel refuses the call."""
    if not any(fits(fitting_configs, case, dtype, config) for config in TUNING_CONFIGS):
        tensors, args = inputs(*case, dtype)
        with pytest.raises(ValueError, match="shared memory: use FLA's"):
            chunk_fwd_o_triton(*tensors, **args)
        return
    check(case, dtype, None)


@pytest.mark.parametrize(
    "case", [GPU_CASES[1], GPU_CASES[2], GPU_CASES[3]], ids=["K128", "K256", "K256-value-first"]
)
@pytest.mark.parametrize("config", TUNING_CONFIGS, ids=[f"config{i}" for i in range(len(TUNING_CONFIGS))])
def test_every_launch_setting(case, config):
    """Each tuning setting, pinned, compiles and matches in bf16 at K 128; at the 340M model's K 256 (both state
    layouts) the shared-memory bound leaves it out, and training keeps FLA's kernels there."""
    launch = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    if not fits(fitting_configs, case, torch.bfloat16, config):
        assert case[0] == 256, "the settings fit below K 256"
        return
    check(case, torch.bfloat16, launch)


@pytest.mark.parametrize("case", GPU_CASES)
def test_equals_flas_functions(case):
    """The same call to FLA's chunk_gated_delta_rule_fwd_h and then chunk_fwd_o gives the same o and final state
    within bf16 rounding."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o

    tensors, args, result = check(case, torch.bfloat16, PINNED)
    q, k, w, u = tensors
    scale = args.pop("scale")
    h, v_new, final_state = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, **args)
    o = chunk_fwd_o(
        q=q,
        k=k,
        v=v_new,
        h=h,
        g=args["g"],
        scale=scale,
        cu_seqlens=args["cu_seqlens"],
        state_v_first=args["state_v_first"],
    )
    assert_close(("o", "final state"), result, (o, final_state), GPU_LIMITS[torch.bfloat16])


def test_training_runs_it_for_keys_up_to_128():
    """The calls a training forward that keeps no chunk states hands it: K up to 128 (where it beat FLA's two
    kernels), bf16, value-first states."""

    def call(key_dim, dtype=torch.bfloat16, state_v_first=True):
        return serves(torch.zeros(1, 64, 1, key_dim, device="cuda", dtype=dtype), 64, state_v_first)

    assert call(128) and call(96) and call(64)
    assert not call(256) and not call(192)
    assert not call(128, torch.float32) and not call(128, state_v_first=False)
