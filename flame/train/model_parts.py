"""Where a training run's model lives: the process topology (device, meshes, groups) and the model parts that
``build_model_parts`` builds on the meta device, parallelizes (or splits into pipeline stages), materializes and
initializes. The Trainer, the throughput bench and the parallel test harness all build their models here."""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger

from flame.loss import TokenNormalizedLoss
from flame.models import build_model
from flame.models.common.args import ModelArgs
from flame.parallelize import parallelize_model, pipeline_model, tie_embeddings
from flame.train.kernels import choose_kernels


@dataclass
class Topology:
    """This process's device and its places in the parallel meshes."""

    device: torch.device
    parallel_dims: ParallelDims
    dp_degree: int  # ranks that read different batches
    dp_rank: int
    # Context parallelism: the ranks of a cp group read the same batch and each trains on a slice of every row.
    cp_group: torch.distributed.ProcessGroup | None
    # Data parallel x cp: together these ranks hold every labelled token of a step.
    loss_mesh: torch.distributed.DeviceMesh | None

    @classmethod
    def of(cls, parallel_dims: ParallelDims, device: torch.device) -> "Topology":
        if parallel_dims.dp_enabled:
            batch_mesh = parallel_dims.get_mesh("batch")
            dp_degree, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
        else:
            dp_degree, dp_rank = 1, 0
        return cls(
            device=device,
            parallel_dims=parallel_dims,
            dp_degree=dp_degree,
            dp_rank=dp_rank,
            cp_group=parallel_dims.get_mesh("cp").get_group() if parallel_dims.cp_enabled else None,
            # Asked only when some exist: the first mesh lookup builds every mesh, which needs process groups.
            loss_mesh=parallel_dims.get_optional_mesh("loss")
            if parallel_dims.dp_enabled or parallel_dims.cp_enabled
            else None,
        )

    @property
    def pp_mesh(self) -> torch.distributed.DeviceMesh | None:
        return self.parallel_dims.get_mesh("pp") if self.parallel_dims.pp_enabled else None


@dataclass
class ModelParts:
    """The parallelized model of this rank: one part, or its pipeline stages and the schedule that runs them."""

    parts: list[nn.Module]
    nparams: int
    flops_per_token: int
    loss_parallel: bool = False  # logits stay sharded over the vocabulary (a DTensor) for the loss
    # Pipeline parallelism: the schedule runs forward + backward with ``pipeline_loss``; only the ranks holding
    # the first stage feed tokens, only those holding the last one compute the loss.
    schedule: object | None = None
    pipeline_loss: TokenNormalizedLoss | None = None
    has_first_stage: bool = True
    has_last_stage: bool = True

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


def build_model_parts(
    model_args: ModelArgs,
    topology: Topology,
    job_config,
    *,
    initialize: Callable[[nn.Module], None] | None = None,
    loss_parallel: bool = False,
    sequence_parallel: bool = True,
) -> ModelParts:
    """Build the model on the meta device, parallelize it with ``job_config``'s plan (pipeline stages with
    parallelism.pipeline_parallel_degree > 1), materialize each part on the device (the CPU with
    training.enable_cpu_offload) and initialize it: ``init_weights`` unless ``initialize`` says otherwise. On a GPU
    the kernels are prepared first (flame.train.kernels)."""
    choose_kernels(job_config, topology.device)
    with torch.device("meta"):
        model = build_model(model_args)
    nparams, flops_per_token = model_args.get_nparams_and_flops(
        model, job_config.training.attention_context()
    )
    logger.info(f"Model {model_args.model_type}: {nparams:,} parameters, {flops_per_token:,} FLOPs/token")
    parallel_dims = topology.parallel_dims
    if parallel_dims.pp_enabled:
        pipeline_loss = TokenNormalizedLoss()
        schedule, parts, first, last = pipeline_model(
            model, parallel_dims, job_config, topology.device, pipeline_loss
        )
        built = ModelParts(parts, nparams, flops_per_token, False, schedule, pipeline_loss, first, last)
    else:
        model = parallelize_model(
            model, parallel_dims, job_config, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel
        )
        built = ModelParts([model], nparams, flops_per_token, loss_parallel and parallel_dims.tp_enabled)
    device = "cpu" if job_config.training.enable_cpu_offload else topology.device
    for part in built.parts:
        materialize(part, device, initialize)
        part.train()
    return built


def materialize(
    part: nn.Module, device: torch.device | str, initialize: Callable[[nn.Module], None] | None = None
) -> None:
    """Give a model (part) built on the meta device its memory on ``device`` and its initial values:
    ``init_weights`` (drawn from the random state at this point) unless ``initialize`` says otherwise."""
    part.to_empty(device=device)
    tie_embeddings(part)  # to_empty unties a shared plain Parameter
    if initialize is None:
        part.init_weights()
    else:
        initialize(part)


def autocast_context(topology: Topology, job_config) -> contextlib.AbstractContextManager:
    """bf16 autocast on a GPU without FSDP (FSDP casts the parameters itself); CPU runs train in float32
    throughout, since bf16 autocast is slower than float32 on CPUs."""
    if topology.device.type != "cuda":
        return contextlib.nullcontext()
    return dist_utils.maybe_enable_amp(
        topology.parallel_dims, job_config.training.mixed_precision_param, topology.device.type
    )
