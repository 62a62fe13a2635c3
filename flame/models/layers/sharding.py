"""The local tensor of a parameter that tensor parallelism turned into a DTensor.

Mixers compute on plain local tensors (their own heads; FLA's kernels take no DTensors). Parameters that the
tensor-parallel plan (flame.parallelize.tensor_parallel) distributes but that no DTensor-aware module consumes
(norm weights, short-conv kernels, A_log/dt_bias, per-head query scales) are read through :func:`local_param`:
a sharded parameter gives this rank's shard (its gradient stays sharded); a replicated one gives the full tensor.
On a module whose input holds only this rank's heads or sequence chunk, the plan sets ``tp_sharded_input``: the
gradient of a replicated parameter is then a partial sum over ranks and is reduced (by FSDP's reduce, or
``redistribute``) before the optimizer uses it. Without tensor parallelism parameters are returned unchanged.
"""

import sys

import torch
from torch import nn


def is_dtensor(tensor: torch.Tensor) -> bool:
    # No DTensor exists before torch.distributed.tensor is imported, and importing it costs a process that builds
    # no parallel model (train.sh's pre-flight) ~0.7 s (sympy, through DTensor's sharding propagation).
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (a view: in-place ops on it change the DTensor), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_param(module: nn.Module, name: str) -> torch.Tensor | None:
    param = getattr(module, name)
    if not is_dtensor(param):
        return param
    from torch.distributed.tensor import Partial

    if getattr(module, "tp_sharded_input", False):
        grads = [Partial() if p.is_replicate() else p for p in param.placements]
        return param.to_local(grad_placements=grads)
    return param.to_local()
