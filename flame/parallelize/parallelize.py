"""The parallelization plan of flame's models, in torchtitan's order: float8 conversion, tensor parallelism,
activation checkpointing, per-block torch.compile, activation offloading around each (compiled) block, then
FSDP2/HSDP per block + root, or DDP."""

import torch
from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flame.errors import ConfigError
from flame.models import model_spec
from flame.parallelize.activation_checkpoint import apply_activation_checkpointing
from flame.parallelize.activation_offload import apply_activation_offload
from flame.parallelize.checks import check_parallelism
from flame.parallelize.compile import compile_blocks, graphs_compiled_blocks, graphs_eager_blocks
from flame.parallelize.float8 import apply_float8
from flame.parallelize.fsdp import apply_ddp, apply_fsdp
from flame.parallelize.generic_tensor_parallel import apply_generic_tp
from flame.parallelize.tensor_parallel import apply_tp, reduce_partial_grads


def parallelize_model(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config,
    *,
    loss_parallel: bool = False,
    sequence_parallel: bool = True,
) -> nn.Module:
    """Parallelize a flame model built on the meta device (or one pipeline stage of it), in place.

    ``loss_parallel``: with tensor parallelism, leave the logits sharded over the vocabulary (a DTensor); the
    caller must then compute the loss and run backward under ``torch.distributed.tensor.parallel.loss_parallel()``.
    Off by default: the logits are gathered to a plain tensor and any loss code works. Generic-path models take
    tensor parallelism without sequence or loss parallelism (flame.parallelize.generic_tensor_parallel).
    """
    check_parallelism(job_config, model.args, parallel_dims.world_size, model=model)
    on_gpu = torch.cuda.is_available()
    float8 = apply_float8(model, job_config, parallel_dims)
    if float8 is not None:
        model.float8_converter = float8  # the trainer calls its post_optimizer_hook after each step

    if parallel_dims.tp_enabled and model.args.generic:
        if loss_parallel:
            raise ConfigError(
                f"{model.args.model_type} models (generic path) do not support loss parallelism; compute the loss "
                "on the whole logits"
            )
        apply_generic_tp(model, parallel_dims.get_mesh("tp"), model_spec(model.args).blocks(model))
        if not parallel_dims.fsdp_enabled:
            reduce_partial_grads(model)
    elif parallel_dims.tp_enabled:
        apply_tp(
            model,
            parallel_dims.get_mesh("tp"),
            # Pipeline stages pass full-length hidden states: the next stage derives positions from them.
            sequence_parallel=sequence_parallel and not parallel_dims.pp_enabled,
            loss_parallel=loss_parallel and not job_config.parallelism.disable_loss_parallel,
        )
        if not parallel_dims.fsdp_enabled:
            reduce_partial_grads(model)
    if job_config.activation_checkpoint.mode != "none":
        apply_activation_checkpointing(model, job_config)
    if job_config.compile.enable and "model" in job_config.compile.components:
        compile_blocks(
            model,
            job_config.compile.backend,
            job_config.compile.mode,
            graph_eager_blocks=graphs_eager_blocks(job_config, parallel_dims.world_size, on_gpu),
            compile_graphed_blocks=job_config.compile.compile_graphed_blocks,
            graph_compiled_blocks=graphs_compiled_blocks(job_config, parallel_dims.world_size, on_gpu),
        )
    if job_config.activation_offload.mode == "full":
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        apply_activation_offload(model, device)

    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            # CPU runs stay in float32 (bf16 is slower there); GPUs gather bf16 and reduce in float32.
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
            if on_gpu
            else torch.float32,
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_policy=job_config.parallelism.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
            blocks_per_unit=job_config.parallelism.fsdp_blocks_per_unit,
        )
        logger.info("Applied %s to the model", "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP")
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), compile_enabled=job_config.compile.enable)
    return model


def tie_embeddings(model: nn.Module) -> None:
    """Re-tie lm_head to the embeddings after ``model.to_empty()``, which gives each module its own copy of a
    shared plain Parameter (DTensor parameters of FSDP/TP runs keep the tie: they are swapped in place). Call it
    after to_empty and before init_weights or loading weights; a no-op for untied models and intact ties."""
    embeddings, lm_head = getattr(model, "embeddings", None), getattr(model, "lm_head", None)
    if embeddings is None or lm_head is None or not model.args.tie_word_embeddings:
        return
    if lm_head.weight is not embeddings.weight:
        lm_head.weight = embeddings.weight
