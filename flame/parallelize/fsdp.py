"""Data parallelism: FSDP2 / HSDP per block + root, or DDP, all reducing gradients by SUM.

flame's trainer divides the summed loss by the global count of labelled tokens (over all data-parallel ranks and
micro-batches), so every rank's gradient is already its share of the global mean: the data-parallel reduction
must add the shares, not average them. FSDP gets gradient_divide_factor 1; DDP, which always averages, gets a
communication hook that sums.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torchtitan.tools.logging import logger

from flame import compat
from flame.models import model_spec


def reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    """torchtitan's policy: "default" keeps parameters gathered between pipeline micro-batches."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not pp_enabled


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_policy: str = "default",
    pp_enabled: bool = False,
    blocks_per_unit: int = 1,
) -> None:
    """Shard per block (one all-gather per block, never per parameter: seed 004's 16x slowdown; the family's
    spec says where the blocks are), or per ``blocks_per_unit`` consecutive blocks of a stack, then the
    embeddings, the final norm + lm head where the model names them as flame's families do, and the root for
    whatever is left (a generic family's edges). ``mesh`` is 1-D (FSDP) or 2-D (dp_replicate, fsdp: HSDP).
    Pipeline stages may lack embeddings, norm or lm_head (None)."""
    config = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        # Pinned host memory (faster copies to the GPU) needs an accelerator.
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    reshard = reshard_after_forward(reshard_policy, pp_enabled)
    embeddings, norm, lm_head = (getattr(model, name, None) for name in ("embeddings", "norm", "lm_head"))
    tied = embeddings is not None and lm_head is not None and lm_head.weight is embeddings.weight
    if embeddings is not None and not tied:  # a tied matrix must live in one group: the root's
        fully_shard(embeddings, **config, reshard_after_forward=reshard)
    for stack in model_spec(model.args).blocks(model):
        blocks = list(stack.children())
        for first in range(0, len(blocks), blocks_per_unit):
            unit = blocks[first : first + blocks_per_unit]
            # A list is one unit: FSDP gathers it before its first block's forward, frees it after its last.
            fully_shard(unit if len(unit) > 1 else unit[0], **config, reshard_after_forward=reshard)
    if norm is not None and lm_head is not None and not tied:
        # The last group is needed right after forward: keep it gathered (torchtitan's default).
        fully_shard([norm, lm_head], **config, reshard_after_forward=reshard_policy == "always")
    fully_shard(model, **config)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The trainer divides the loss by the global token count, so FSDP must sum, not average.
            module.set_gradient_divide_factor(1.0)
            compat.fsdp_sum_reductions_on_gloo(module, mesh)
    if cpu_offload:
        logger.info("Applied CPU offloading of parameters, gradients and optimizer states")


def _allreduce_sum_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce SUM (DDP's default hook divides by the world size first). The
    all-reduce is in place, so the bucket's own buffer is the result (the future's value is backend-specific: a
    fake process group's is None)."""
    buffer = bucket.buffer()
    work = dist.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(lambda _: buffer)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, compile_enabled: bool = False) -> None:
    """Composable DDP (parameter names unchanged, so checkpoints are the same as without it), summing gradients.
    Parameters stay in float32; the trainer's autocast provides bf16 compute on GPU. DDP broadcasts rank 0's
    parameters when it initialises (at the first forward)."""
    if compile_enabled:
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    model.register_comm_hook(mesh.get_group(), _allreduce_sum_hook)
    logger.info("Applied DDP to the model (gradients summed over %d ranks)", mesh.size())
