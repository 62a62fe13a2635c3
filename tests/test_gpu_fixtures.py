"""tests/gpu/conftest.py's pruning of FLA's autotuning, on a CPU (tests/gpu is collected only with a GPU; building an
autotuner needs none)."""

import triton
import triton.language as tl

from tests.gpu.conftest import first_config_for_fla

CONFIGS = [triton.Config({"BLOCK": block}) for block in (16, 32, 64)]


def autotuned_kernel_of(module: str):
    def kernel(x, BLOCK: tl.constexpr):
        pass

    kernel.__module__ = module
    return triton.autotune(configs=CONFIGS, key=[])(triton.jit(kernel))


def test_fla_kernels_keep_their_first_config_and_others_keep_all():
    prune = first_config_for_fla(type(autotuned_kernel_of("fla.ops.x")).prune_configs)
    assert prune(autotuned_kernel_of("fla.ops.gated_delta_rule.chunk"), {}) == CONFIGS[:1]
    assert prune(autotuned_kernel_of("flame.ops.short_conv.triton_kernel"), {}) == CONFIGS
    assert prune(autotuned_kernel_of("flash_qla.ops"), {}) == CONFIGS


def test_a_kernels_own_pruning_comes_first():
    def keep_large(configs, named_args, **kwargs):
        return [config for config in configs if config.kwargs["BLOCK"] >= 32]

    def kernel(x, BLOCK: tl.constexpr):
        pass

    kernel.__module__ = "fla.ops.y"
    tuned = triton.autotune(configs=CONFIGS, key=[], prune_configs_by={"early_config_prune": keep_large})(
        triton.jit(kernel)
    )
    tuned.nargs = {"x": None}
    prune = first_config_for_fla(type(tuned).prune_configs)
    assert [config.kwargs["BLOCK"] for config in prune(tuned, {})] == [32]
