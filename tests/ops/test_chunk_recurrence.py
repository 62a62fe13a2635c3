"""The sequential recurrences' shared-memory bounds (fwd_h, fwd_o and dhu's ``shared_memory_bytes``, by which
chunk_recurrence.fitting keeps a launch setting out of tuning) against Triton's own compiler: each kernel compiled
on the CPU for an H100 (sm_90, no GPU needed) in each form (dhu with dv given and with it formed in the kernel)
at each of its tuning settings, K 128 and the 340M model's K 256, bf16 and float32 inputs, both state layouts. A
setting the bound admits within the H100's shared memory compiles within it, so tuning and the GPU tests launch
only settings the GPU can run; with bf16 inputs (training's) the compiled kernel takes no more than the bound.
(With float32 inputs and value-first states the compiler asks up to 4.6% more than the bound, in settings over
the H100's shared memory either way but fwd_h's BV 64, 2 stages at K 128: 196,868 bytes against the bound's
196,608, Triton 3.6 and 3.7.)"""

import importlib

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flame.ops.gated_delta_rule.chunk_recurrence import key_block

H100 = GPUTarget("cuda", 90, 32)
H100_SHARED_MEMORY = 232448  # bytes a block may use (torch's max_shared_memory_per_block_optin on an H100)
KERNELS = {"fwd_h_triton": "_fwd_h_kernel", "fwd_o_triton": "_fwd_o_kernel", "dhu_triton": "_dhu_kernel"}
FLAGS = {
    "dhu_triton": [{}, {"LOCAL_DV": True}]
}  # the forms a kernel compiles to: dhu with dv given or formed
SCALARS = {"scale": "fp32", "T": "i32"}
FLOAT32_POINTERS = {"g", "h0", "ht", "dht", "dh0"}  # the gate and the initial and final states (or gradients)
INDEX_POINTERS = {"cu_seqlens", "chunk_offsets"}


def compile_for_h100(kernel, signature: dict, constexprs: dict, aligned: list, config: triton.Config):
    """``kernel`` compiled for sm_90 with Triton's compiler (no GPU needed), the pointers and integers at the
    positions ``aligned`` specialized as multiples of 16, as Triton specializes training's calls."""
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs=constexprs,
        attrs={index: [["tt.divisibility", 16]] for index in aligned},
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=H100, options=options)


def compiled_shared_memory(
    kernel, key_dim: int, value_dim: int, dtype: str, state_v_first: bool, config, flags: dict
) -> int:
    """Bytes of shared memory Triton's compiler gives ``kernel`` for sm_90 at this call (``flags``: the kernel's own
    constexpr flags that are on): pointers aligned to 16 bytes and T a multiple of 16, as training's calls are
    specialized."""
    assert set(flags) <= {param.name for param in kernel.params if param.is_constexpr}, flags
    signature, constexprs, aligned = {}, {}, []
    values = dict(H=2, HV=2, K=key_dim, V=value_dim, BT=64, BK=key_block(key_dim), BV=config.kwargs["BV"],
                  USE_G=True, STATE_V_FIRST=state_v_first, IS_VARLEN=False, PRECISION="tf32", **flags)  # fmt: skip
    for index, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(index,)] = values.get(name, False)  # the flags not named: initial/final states off
            continue
        if name in SCALARS:
            signature[name] = SCALARS[name]
        else:
            signature[name] = (
                "*fp32" if name in FLOAT32_POINTERS else "*i64" if name in INDEX_POINTERS else dtype
            )
        if name != "scale":
            aligned.append((index,))
    return compile_for_h100(kernel, signature, constexprs, aligned, config).metadata.shared


CASES = [
    (module, flags, index, key_dim, value_dim, dtype, state_v_first)
    for module in KERNELS
    for flags in FLAGS.get(module, [{}])
    for index in range(len(importlib.import_module(f"flame.ops.gated_delta_rule.{module}").TUNING_CONFIGS))
    for key_dim, value_dim in [(128, 128), (256, 512)]
    for dtype in ["*bf16", "*fp32"]
    for state_v_first in [True, False]
]


@pytest.mark.parametrize(
    ("module", "flags", "index", "key_dim", "value_dim", "dtype", "state_v_first"), CASES
)
def test_compiled_shared_memory_is_within_the_bound(
    module, flags, index, key_dim, value_dim, dtype, state_v_first
):
    kernels = importlib.import_module(f"flame.ops.gated_delta_rule.{module}")
    config = kernels.TUNING_CONFIGS[index]
    element_size = 2 if dtype == "*bf16" else 4
    bound = kernels.shared_memory_bytes(config, key_block(key_dim), 64, element_size, state_v_first)
    kernel = getattr(kernels, KERNELS[module])
    compiled = compiled_shared_memory(kernel, key_dim, value_dim, dtype, state_v_first, config, flags)
    if bound <= H100_SHARED_MEMORY:
        assert compiled <= H100_SHARED_MEMORY, (
            f"admitted by its bound ({bound}), compiled to {compiled} bytes"
        )
    if dtype == "*bf16":
        assert compiled <= bound
