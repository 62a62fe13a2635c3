"""flame's dq/dk/dw/dg kernel compiled on the CPU for an H100 (sm_90, no GPU needed) at gated_deltanet_340M's heads
(K 256, V 512), bf16, value-first states, with dw: every tuning setting for rows of a batch, and the tuned one (BV
64, 4 warps, 3 stages on an H100) for packed sequences. The interpreted test checks the kernel's results; this one
that Triton's Hopper code generation takes each form, within the H100's shared memory, as the launches that tuning
and training make."""

import pytest
import triton

from flame.ops.gated_delta_rule import dqkwg_triton
from tests.ops.test_chunk_recurrence import H100_SHARED_MEMORY, compile_for_h100

SCALARS = {"scale": "fp32", "T": "i32", "num_tokens": "i32"}
FLOAT32_POINTERS = {"g", "dg"}
INDEX_POINTERS = {"cu_seqlens", "chunk_indices"}  # int32, as FLA's backward passes them


def compiled(config: triton.Config, varlen: bool):
    kernel = dqkwg_triton._dqkwg_kernel
    values = dict(H=6, HV=6, K=256, V=512, BT=64, BK=dqkwg_triton.BLOCK_K, STATE_V_FIRST=True, USE_DW=True,
                  IS_VARLEN=varlen, PRECISION="tf32", **config.kwargs)  # fmt: skip
    signature, constexprs, aligned = {}, {}, []
    for index, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(index,)] = values[name]
            continue
        signature[name] = SCALARS.get(name) or (
            "*fp32" if name in FLOAT32_POINTERS else "*i32" if name in INDEX_POINTERS else "*bf16"
        )
        if name not in SCALARS:
            aligned.append((index,))
    return compile_for_h100(kernel, signature, constexprs, aligned, config)


TUNED = triton.Config({"BV": 64}, num_warps=4, num_stages=3)
CASES = [(config, False) for config in dqkwg_triton.TUNING_CONFIGS] + [(TUNED, True)]


def case_id(config: triton.Config, varlen: bool) -> str:
    return f"BV{config.kwargs['BV']}-{config.num_warps}warps-{config.num_stages}stages" + (
        "-varlen" if varlen else ""
    )


@pytest.mark.parametrize(("config", "varlen"), CASES, ids=[case_id(*case) for case in CASES])
def test_compiles_for_hopper(config, varlen):
    kernel = compiled(config, varlen)
    assert "wgmma" in kernel.asm["ptx"]  # Hopper's tensor-core products, as on the GPU
    assert kernel.metadata.shared <= H100_SHARED_MEMORY
