"""Pipeline parallelism: torchtitan's stage split and schedules with flame's module names, and a loss that
normalises by the global token count.

torchtitan 0.2.2's ``pipeline_llm`` hands its schedule the summed loss (the trainer divides by the global token
count only outside the pipeline), so its pipeline gradients are ~token-count times too large (torchtitan#2972).
flame's schedule gets :class:`TokenNormalizedLoss`: every micro-batch's summed cross-entropy divided by the labelled
tokens of the whole step over all data-parallel ranks, which the trainer sets before each step. The micro-batch
losses then add up to exactly what a run without pipeline parallelism computes, and the schedule is built with
``scale_grads=False`` (torchtitan's setting) so nothing divides them again.

The model's forward already tolerates the pieces a stage lacks (embeddings, norm, lm_head set to None; a middle
stage takes hidden states where the first takes token ids), and ``init_weights`` initialises what is there.
"""

import torch
from torch import nn
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    build_pipeline_schedule,
    generate_llm_fqn_per_model_part,
    pipeline_module_split,
)
from torchtitan.tools.logging import logger

from flame.loss import TokenNormalizedLoss
from flame.parallelize.checks import check_parallelism, pipeline_stages

# torchtitan's generic names -> flame's
RENAMES = {"tok_embeddings": "embeddings", "output": "lm_head"}


def stage_module_names(job_config, num_layers: int) -> list[list[str]]:
    parallelism = job_config.parallelism
    if parallelism.module_fqns_per_model_part is not None:
        return parallelism.module_fqns_per_model_part
    names = generate_llm_fqn_per_model_part(
        pipeline_stages(parallelism, num_layers),
        num_layers,
        parallelism.pipeline_parallel_first_stage_less_layers,
        parallelism.pipeline_parallel_last_stage_less_layers,
    )
    return [[RENAMES.get(name, name) for name in stage] for stage in names]


def pipeline_model(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config,
    device: torch.device,
    loss_fn: TokenNormalizedLoss,
    parallelize_fn=None,
):
    """Split a flame model (on the meta device) into this rank's pipeline stages, parallelize each with
    ``parallelize_fn`` (default: flame's parallelize_model) and build the schedule.

    Returns (schedule, model_parts, has_first_stage, has_last_stage), like torchtitan's ``pipeline_llm``.
    """
    if parallelize_fn is None:
        from flame.parallelize.parallelize import parallelize_model as parallelize_fn

    check_parallelism(job_config, model.args, parallel_dims.world_size, model=model)
    names = stage_module_names(job_config, model.args.num_hidden_layers)
    stages, model_parts = pipeline_module_split(
        model,
        parallel_dims.get_mesh("pp"),
        job_config.parallelism.pipeline_parallel_schedule,
        device,
        names,
    )
    for i, part in enumerate(model_parts):
        model_parts[i] = parallelize_fn(part, parallel_dims, job_config)
        stages[i].submod = model_parts[i]
    schedule = build_pipeline_schedule(job_config, stages, loss_fn)
    logger.info("Pipeline stages of this rank: %s", [names[stage.stage_index] for stage in stages])
    return (
        schedule,
        model_parts,
        any(stage.is_first for stage in stages),
        any(stage.is_last for stage in stages),
    )
