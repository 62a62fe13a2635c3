"""flame's Triton dh recurrence on the GPU against the PyTorch one (float64 on the same inputs) and against FLA's
``chunk_gated_delta_rule_bwd_dhu``, whose results it must equal for the same call.

bf16 inputs (training) and float32 (exact products, ``exact_float32``), the seed configs' head sizes (K 64/128/256,
V up to 512), both state layouts, gated and plain, the initial state and the final state's gradient, grouped value
heads and varlen; dv given, or its intra-chunk part formed in the kernel (against FLA's chunk_bwd_dv_local
followed by its dh recurrence). Limits on the relative RMS error ||x - ref|| / ||ref||: 1e-5 in float32, 0.01 in
bf16 (dh and dv2 are stored in bf16 as FLA stores them).
"""

import contextlib
import math

import pytest
import torch
from triton.runtime.errors import OutOfResources

from flame.ops.gated_delta_rule.dhu_reference import chunk_bwd_dhu_torch
from flame.ops.gated_delta_rule.dhu_triton import TUNING_CONFIGS, chunk_bwd_dhu_triton, fitting_configs
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
PINNED = {"BV": 32, "num_warps": 4, "num_stages": 2}


def inputs(key_dim, value_dim, heads, v_heads, shape, v_first, gated, states, dtype):
    torch.manual_seed(0)
    batch, seq_len, cu_seqlens, sequences = gpu_layout(shape)
    device = torch.device("cuda")
    q = torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, key_dim, device=device), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, key_dim, device=device), dim=-1)
    w = torch.randn(batch, seq_len, v_heads, key_dim, device=device) / math.sqrt(key_dim)
    do = torch.randn(batch, seq_len, v_heads, value_dim, device=device)
    dv = torch.randn_like(do)
    g = None
    if gated:
        g = chunk_local_decay(batch, seq_len, v_heads, 64, cu_seqlens, device, rate=0.1)
    state = (value_dim, key_dim) if v_first else (key_dim, value_dim)
    h0 = torch.randn(sequences, v_heads, *state, device=device) if states else None
    dht = torch.randn(sequences, v_heads, *state, device=device) if states else None
    tensors = [x.to(dtype) for x in (q, k, w, do, dv)]
    return tensors, dict(
        g=g, h0=h0, dht=dht, scale=key_dim**-0.5, state_v_first=v_first, cu_seqlens=cu_seqlens
    )


def check(case, dtype, launch, local_dv=False):
    """The kernel's results against the float64 reference; dv None (formed in the kernel) with ``local_dv``."""
    tensors, args = inputs(*case, dtype)
    *qkwdo, dv = tensors
    dv = None if local_dv else dv
    result = chunk_bwd_dhu_triton(*qkwdo, dv, **args, launch=launch)
    expected = chunk_bwd_dhu_torch(*(x.double() for x in qkwdo), None if dv is None else dv.double(),
                                   **as_float64(args))  # fmt: skip
    assert_close(("dh", "dh0", "dv2"), result, expected, GPU_LIMITS[dtype])
    return tensors, args, result


@pytest.mark.parametrize("local_dv", [False, True], ids=["dv", "local-dv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_matches_pytorch(case, dtype, local_dv):
    """Autotuned over the settings that fit; where none does (float32 at K 256), the kernel refuses the call."""
    if not any(fits(fitting_configs, case, dtype, config) for config in TUNING_CONFIGS):
        tensors, args = inputs(*case, dtype)
        with pytest.raises(ValueError, match="shared memory: use FLA's"):
            chunk_bwd_dhu_triton(*tensors[:4], None if local_dv else tensors[4], **args)
        return
    check(case, dtype, None, local_dv)


@pytest.mark.parametrize(
    "case", [GPU_CASES[1], GPU_CASES[2], GPU_CASES[3]], ids=["K128", "K256", "K256-value-first"]
)
@pytest.mark.parametrize("config", TUNING_CONFIGS, ids=[f"config{i}" for i in range(len(TUNING_CONFIGS))])
@pytest.mark.parametrize("local_dv", [False, True], ids=["dv", "local-dv"])
def test_every_launch_setting(case, config, local_dv):
    """Each tuning setting in bf16 at K 128 and at the 340M model's K 256 with both state layouts: a setting Triton
    miscompiles fails here. The shared-memory bound is an upper bound (tests/ops/test_chunk_recurrence.py), so a
    setting it leaves out of tuning may still compile (BV 64 / 2 stages key-first at K 256: 229,892 bytes for sm_90
    with Triton 3.7.1, the bound 262,144); where one does, its results must be right."""
    launch = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    if fits(fitting_configs, case, torch.bfloat16, config):
        check(case, torch.bfloat16, launch, local_dv)
    else:
        with contextlib.suppress(OutOfResources):
            check(case, torch.bfloat16, launch, local_dv)


@pytest.mark.parametrize("case", GPU_CASES)
def test_equals_flas_function(case):
    """The same call to FLA's chunk_gated_delta_rule_bwd_dhu gives the same results within bf16 rounding."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu

    tensors, args, result = check(case, torch.bfloat16, PINNED)
    q, k, w, do, dv = tensors
    theirs = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, **args)
    assert_close(("dh", "dh0", "dv2"), result, theirs, GPU_LIMITS[torch.bfloat16])


@pytest.mark.parametrize("case", GPU_CASES)
def test_with_local_dv_equals_flas_two_functions(case):
    """Without dv, the kernel's results equal those of FLA's chunk_bwd_dv_local followed by its dh recurrence within
    bf16 rounding (FLA rounds the intra-chunk dv to bf16 between the two; flame keeps it in float32)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    tensors, args, result = check(case, torch.bfloat16, PINNED, local_dv=True)
    q, k, w, do, _ = tensors
    local = {name: args[name] for name in ("g", "scale", "cu_seqlens")}
    dv = chunk_bwd_dv_local(q=q, k=k, do=do, **local)
    theirs = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, do=do, dv=dv, **args)
    assert_close(("dh", "dh0", "dv2"), result, theirs, GPU_LIMITS[torch.bfloat16])
