"""Every workaround for a torch / torchtitan / FLA quirk lives here, each with the upstream issue it tracks.

Call :func:`apply` once per process, after importing torch and before building meshes or models.
"""

import importlib.util
import sys
import types

import torch


def torchtitan_job_config() -> type:
    """torchtitan's JobConfig class without running ``torchtitan/__init__.py``.

    That init imports torchtitan's quantization converters (~3 s on a 2-core machine) although the config
    schema needs none of it; the launcher's pre-flight check only parses options and must answer within
    seconds. When torchtitan is already imported (the trainer), the regular module is used. Only processes
    that never train take the shortcut: the bare package stays in sys.modules for their lifetime.
    """
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        bare = types.ModuleType("torchtitan")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = bare
    from torchtitan.config.job_config import JobConfig

    return JobConfig


def apply() -> None:
    _register_fake_process_group()
    _use_cpu_when_no_accelerator()
    _profile_cpu_only_without_gpu()


def fsdp_sum_reductions_on_gloo(fsdp_module, mesh) -> None:
    """Make an FSDP2 module reduce gradients with plain SUM when its mesh communicates over gloo."""
    # pytorch#162338: gloo has no ReduceOp.PREMUL_SUM ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), and FSDP2
    # averaging on gloo silently sums. Summing is what flame wants anyway: the trainer divides the loss by the
    # global token count.
    import torch.distributed as dist

    if dist.get_backend(mesh.get_group(mesh.ndim - 1)) == "gloo":
        fsdp_module.set_force_sum_reduction_for_comms(True)


def _register_fake_process_group() -> None:
    # torchtitan#2236, #2275: ParallelDims.build_mesh() gives size-1 mesh dims the c10d backend "fake"; torch 2.11
    # raises "Unknown c10d backend type FAKE" unless this module registered it (a no-op on torch >= 2.13).
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


class _CpuDeviceModule(types.SimpleNamespace):
    """The few ``torch.cuda``-style calls torchtitan makes on its device module, answered for the CPU."""

    def __init__(self):
        super().__init__(
            set_device=lambda device: None,
            current_device=lambda: 0,
            synchronize=lambda *a: None,
            empty_cache=lambda: None,
            device_count=lambda: 1,
        )


def _use_cpu_when_no_accelerator() -> None:
    # torchtitan 0.2.2 tools/utils.get_device_info() falls back to "cuda" when torch finds no accelerator, so a
    # CPU-only run picks the NCCL backend and calls torch.cuda.set_device (no upstream issue filed; see
    # shared notes). Point its module-level device globals at the CPU and gloo instead.
    if torch.accelerator.is_available():
        return
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    cpu_module = _CpuDeviceModule()
    for module in (tools_utils, parallel_dims, dist_utils):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu_module


def _profile_cpu_only_without_gpu() -> None:
    # torchtitan 0.2.2 tools/profiling.maybe_enable_profiling passes activities=[CPU, None] when neither CUDA nor
    # XPU is available, and torch.profiler.profile rejects the None ("Expected ProfilerActivity or dict"; no
    # upstream issue filed). Give that module a torch whose profiler drops it.
    if torch.cuda.is_available() or torch.xpu.is_available():
        return
    import torchtitan.tools.profiling as profiling

    class CpuProfile(torch.profiler.profile):
        def __init__(self, *args, activities=None, **kwargs):
            super().__init__(
                *args, activities=[a for a in activities or () if a is not None] or None, **kwargs
            )

    class TorchWithCpuProfiler(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    patched = TorchWithCpuProfiler("torch")
    patched.profiler = types.SimpleNamespace(
        profile=CpuProfile, schedule=torch.profiler.schedule, ProfilerActivity=torch.profiler.ProfilerActivity
    )
    profiling.torch = patched
