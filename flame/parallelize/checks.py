"""Validation of the parallelism options against the world size and the model, before any rank starts.

:func:`check_parallelism` raises :class:`flame.errors.ConfigError` with one line for: degrees that do not multiply
to the world size; parallelisms flame does not implement (expert); context parallelism with a pipeline schedule
that splits the backward, a sequence length indivisible by cp (x tp with sequence parallelism), or sliding-window
softmax attention (context_parallel.py);
a parallelism (or varlen) the model's family does not declare in its spec;
DDP combined with tensor or pipeline parallelism; unknown compile components; head counts, MLP widths or the
sequence length not divisible by the tensor-parallel degree (a generic-path model: its head counts and
intermediate_size, and a declared plan flame cannot apply); a q/k norm over all heads (``qk_norm_scope`` full)
under tensor parallelism, which splits the heads; more pipeline stages than layers; micro-batch counts the
pipeline schedule cannot run (1F1B and DualPipeV need one per stage); CPU offload without FSDP; an FSDP unit of fewer than one block;
activation-checkpointing and converter options that cannot work; the fused linear cross-entropy
(``fuse_linear_cross_entropy``) with tensor or pipeline parallelism, DPO, or float8 on lm_head. train.sh's pre-flight (flame.launch) calls it
with NGPU x NNODE, and parallelize_model calls it again on the ranks. It imports no torchtitan module, so the
pre-flight stays fast.
"""

from flame.config.checks import l2warp_factor
from flame.errors import ConfigError
from flame.models import model_spec
from flame.models.common.spec import MODEL_PARALLELISMS
from flame.parallelize.float8 import check_converters, float8_enabled

SINGLE_STAGE_SCHEDULES = ("1f1b", "gpipe")
COMPILE_COMPONENTS = ("model", "loss")
# inductor's modes that replay graphs as CUDA graphs, and each one's mode without them.
CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def uses_cuda_graphs(compile_config) -> bool:
    return compile_config.enable and compile_config.mode in CUDA_GRAPH_MODES


def resolved_degrees(parallelism, world_size: int) -> dict[str, int]:
    """{dp_replicate, dp_shard, cp, tp, pp} with dp_shard = -1 resolved to the leftover ranks."""
    names = {
        "dp_replicate": "data_parallel_replicate_degree",
        "dp_shard": "data_parallel_shard_degree",
        "cp": "context_parallel_degree",
        "tp": "tensor_parallel_degree",
        "pp": "pipeline_parallel_degree",
        "ep": "expert_parallel_degree",
        "etp": "expert_tensor_parallel_degree",
    }
    degrees = {}
    for key, field in names.items():
        value = getattr(parallelism, field)
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or (value < 1 and value != -1)
            or (value == -1 and key != "dp_shard")
        ):
            allowed = (
                "a positive integer or -1 (the leftover ranks)" if key == "dp_shard" else "a positive integer"
            )
            raise ConfigError(f"parallelism.{field} must be {allowed}, got {value!r}")
        degrees[key] = value
    others = degrees["dp_replicate"] * degrees["cp"] * degrees["tp"] * degrees["pp"]
    spelled = (
        f"data_parallel_replicate_degree {degrees['dp_replicate']} x context_parallel_degree {degrees['cp']} x "
        f"tensor_parallel_degree {degrees['tp']} x pipeline_parallel_degree {degrees['pp']}"
    )
    if degrees["dp_shard"] == -1:
        if world_size % others:
            raise ConfigError(
                f"{spelled} = {others} does not divide the world size {world_size} (NGPU x NNODE)"
            )
        degrees["dp_shard"] = world_size // others
    elif others * degrees["dp_shard"] != world_size:
        raise ConfigError(
            f"{spelled} x data_parallel_shard_degree {degrees['dp_shard']} = {others * degrees['dp_shard']} "
            f"is not the world size {world_size} (NGPU x NNODE); use data_parallel_shard_degree -1 for the rest"
        )
    return degrees


def mixer_head_counts(mixer) -> dict[str, int]:
    """The head counts of a sequence mixer that tensor parallelism splits."""
    from flame.models.layers.attention import Attention
    from flame.models.layers.delta_net import DeltaNet
    from flame.models.layers.gated_deltanet import GatedDeltaNet

    if isinstance(mixer, Attention):
        return {"attention num_heads": mixer.num_heads, "attention num_kv_heads": mixer.num_kv_heads}
    if isinstance(mixer, GatedDeltaNet):
        return {"GatedDeltaNet num_heads": mixer.num_heads, "GatedDeltaNet num_v_heads": mixer.num_v_heads}
    if isinstance(mixer, DeltaNet):
        return {"DeltaNet num_heads": mixer.num_heads}
    raise ConfigError(f"tensor parallelism has no plan for the mixer {type(mixer).__name__}")


def check_tensor_parallel(model, tp: int, seq_len: int) -> None:
    from flame.models.layers.attention import Attention

    for layer_id, block in model.layers.items():
        if (
            isinstance(block.attn, Attention)
            and block.attn.q_norm is not None
            and block.attn.qk_norm_scope == "full"
        ):
            # Each rank holds only its heads, and the norm's statistics run over all of them.
            raise ConfigError(
                f"tensor parallelism does not support qk_norm_scope full (layer {layer_id}: a q/k norm over all "
                "heads); use tensor_parallel_degree 1 or qk_norm_scope head"
            )
        for what, count in mixer_head_counts(block.attn).items():
            if count % tp:
                raise ConfigError(
                    f"tensor_parallel_degree {tp} does not divide the {what} ({count}) of layer {layer_id}; "
                    f"pick a degree that divides it"
                )
        width = block.mlp.gate_proj.out_features
        if width % tp:
            raise ConfigError(
                f"tensor_parallel_degree {tp} does not divide the MLP intermediate size ({width}) of layer {layer_id}"
            )
    if seq_len % tp:
        raise ConfigError(
            f"training.seq_len {seq_len} is not divisible by tensor_parallel_degree {tp} (sequence parallelism "
            "splits the sequence across the tensor-parallel ranks)"
        )


def check_generic_tensor_parallel(model_args, tp: int) -> None:
    """A generic-path model's declared plan splits the attention heads and the MLP width over the TP ranks."""
    # Imported here: DTensor's modules take ~0.7 s, which a pre-flight without tensor parallelism need not pay.
    from flame.parallelize.generic_tensor_parallel import block_plan

    config = model_args.hf_config()
    block_plan(config)  # a style flame does not map stops here
    heads = config.num_attention_heads
    widths = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, count in widths.items():
        if count % tp:
            raise ConfigError(
                f"tensor_parallel_degree {tp} does not divide the model's {name} ({count}); pick a degree that "
                "divides it"
            )


def pipeline_stages(parallelism, num_layers: int) -> int:
    """Number of pipeline stages torchtitan's rules give: one per rank for single-stage schedules, else
    pipeline_parallel_layers_per_stage decides (default two per rank)."""
    pp = parallelism.pipeline_parallel_degree
    single = parallelism.pipeline_parallel_schedule.lower() in SINGLE_STAGE_SCHEDULES
    if parallelism.module_fqns_per_model_part is not None:
        return len(parallelism.module_fqns_per_model_part)
    per_stage = parallelism.pipeline_parallel_layers_per_stage
    if per_stage is None:
        return pp if single else 2 * pp
    extra = (
        parallelism.pipeline_parallel_first_stage_less_layers
        + parallelism.pipeline_parallel_last_stage_less_layers
    )
    return -(-(num_layers + extra) // per_stage)


def check_pipeline_parallel(job_config, model_args) -> None:
    parallelism = job_config.parallelism
    pp, num_layers = parallelism.pipeline_parallel_degree, model_args.num_hidden_layers
    if model_args.tie_word_embeddings:
        raise ConfigError(
            "pipeline parallelism puts the embeddings and lm_head on different stages, so they cannot share "
            "weights: set tie_word_embeddings false in the model config or pipeline_parallel_degree 1"
        )
    stages = pipeline_stages(parallelism, num_layers)
    if stages > num_layers:
        raise ConfigError(
            f"pipeline parallelism would make {stages} stages from {num_layers} layers; use at most {num_layers} "
            "stages (pipeline_parallel_degree, pipeline_parallel_layers_per_stage)"
        )
    if stages % pp:
        raise ConfigError(
            f"{stages} pipeline stages cannot be spread evenly over pipeline_parallel_degree {pp}"
        )
    microbatch = parallelism.pipeline_parallel_microbatch_size
    batch = job_config.training.local_batch_size
    if batch % microbatch:
        raise ConfigError(
            f"training.local_batch_size {batch} is not divisible by "
            f"parallelism.pipeline_parallel_microbatch_size {microbatch}"
        )
    if parallelism.pipeline_parallel_schedule_csv:
        return
    # torch's schedules (torch/distributed/pipelining/schedules.py) refuse these micro-batch counts only once the
    # ranks have started, with a traceback per rank.
    schedule = parallelism.pipeline_parallel_schedule
    name = schedule.lower()
    micro_batches = batch // microbatch
    counted = f"got {micro_batches} (training.local_batch_size {batch} / pipeline_parallel_microbatch_size {microbatch})"
    if job_config.training.varlen:
        counted += (
            "; training.varlen makes every batch one packed row: use GPipe, LoopedBFS or Interleaved1F1B"
        )
    if name in ("1f1b", "dualpipev") and micro_batches < stages:
        raise ConfigError(
            f"pipeline schedule {schedule} needs at least one micro-batch per stage ({stages}), {counted}"
        )
    rounds = max(1, micro_batches // pp)
    if name in ("interleaved1f1b", "interleavedzerobubble") and micro_batches % rounds:
        raise ConfigError(
            f"pipeline schedule {schedule} needs a micro-batch count divisible by its rounds ({rounds} = "
            f"micro-batches // pipeline_parallel_degree {pp}), {counted}"
        )


def check_family_support(job_config, model_args, degrees: dict[str, int]) -> None:
    """The family's spec lists the parallelisms (and varlen) it supports beyond data parallelism."""
    asked = {
        "tp": degrees["tp"] > 1,
        "pp": degrees["pp"] > 1,
        "cp": degrees["cp"] > 1,
        "varlen": job_config.training.varlen,
    }
    supported = model_spec(model_args).supported(model_args)
    for name, on in asked.items():
        if on and name not in supported:
            remedy = (
                "train them without it (each row then reads as one sequence across its documents)"
                if name == "varlen"
                else "train them with data parallelism (FSDP/HSDP/DDP) instead"
            )
            raise ConfigError(
                f"{model_args.model_type} models do not support {MODEL_PARALLELISMS[name]}; {remedy}"
            )


def check_activation_checkpoint(job_config) -> None:
    ac = job_config.activation_checkpoint
    if ac.mode == "memory_budget":
        if not job_config.compile.enable:
            raise ConfigError(
                "activation_checkpoint.mode memory_budget works through the compiler; add --compile.enable"
            )
        if not 0.0 <= ac.memory_budget <= 1.0:
            raise ConfigError(
                f"activation_checkpoint.memory_budget must be in [0, 1], got {ac.memory_budget}"
            )
    if ac.mode == "selective":
        option = ac.selective_ac_option
        if option != "op" and not (option.isdigit() and int(option) > 0):
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {option!r}"
            )


def check_compile(compile_config, degrees: dict[str, int], varlen: bool) -> None:
    if compile_config.mode != "default" and compile_config.backend != "inductor":
        raise ConfigError(
            f"compile.mode {compile_config.mode} is inductor's; compile.backend is {compile_config.backend}: "
            "drop --compile.mode or use --compile.backend inductor"
        )
    # Measured on an H200 with FSDP over a fake process group of 2 (docs/performance.md, "CUDA graphs"): the blocks'
    # CUDA graphs beside FSDP's parameter gathering made the step 4.4x slower; one GPU's step keeps its speed.
    if uses_cuda_graphs(compile_config) and degrees["dp_shard"] > 1:
        raise ConfigError(
            f"compile.mode {compile_config.mode} replays CUDA graphs, which under FSDP (data_parallel_shard_degree "
            f"{degrees['dp_shard']}) made training 4.4x slower; use DDP (--parallelism.data_parallel_replicate_degree "
            "N --parallelism.data_parallel_shard_degree 1) or --compile.mode max-autotune-no-cudagraphs"
        )
    # A CUDA graph replays the launches its capture recorded, and packed documents' kernels size their launches from
    # each batch's boundaries on the host (FLA's chunk indices); on an H100 GatedDeltaNet's first replayable step
    # failed inductor's check that no tensor outlives the graph unrecorded (docs/performance.md, "CUDA graphs").
    if uses_cuda_graphs(compile_config) and varlen:
        raise ConfigError(
            f"compile.mode {compile_config.mode} replays CUDA graphs recorded for one batch, and packed documents "
            "(training.varlen) change the kernels' launches with every batch's document boundaries; use "
            f"--compile.mode {CUDA_GRAPH_MODES[compile_config.mode]} with --training.varlen"
        )
    unknown = [c for c in compile_config.components if c not in COMPILE_COMPONENTS]
    if unknown:
        raise ConfigError(
            f"compile.components may hold {' and '.join(COMPILE_COMPONENTS)}, got {', '.join(unknown)}"
        )


def check_fused_loss(job_config, model_args, degrees: dict[str, int]) -> None:
    """``fuse_linear_cross_entropy`` applies the whole lm_head weight to this rank's hidden states and returns one
    summed loss (flame/ops/linear_cross_entropy.py)."""
    if not model_args.fuse_linear_cross_entropy:
        return
    off = "or set fuse_linear_cross_entropy false in the model config"
    if degrees["tp"] > 1:
        raise ConfigError(
            "fuse_linear_cross_entropy needs the whole lm_head on each rank and tensor parallelism shards it over "
            f"the vocabulary: use tensor_parallel_degree 1 {off}"
        )
    if degrees["pp"] > 1:
        raise ConfigError(
            "fuse_linear_cross_entropy does not work with pipeline parallelism yet (the schedule's loss takes "
            f"logits): use pipeline_parallel_degree 1 {off}"
        )
    if job_config.job.task == "dpo":
        raise ConfigError(
            "DPO needs per-sequence log-probabilities, which fuse_linear_cross_entropy does not produce: set "
            "fuse_linear_cross_entropy false in the model config for job.task dpo"
        )
    if float8_enabled(job_config) and not any(
        name in "lm_head" for name in job_config.quantize.linear.float8.filter_fqns
    ):
        raise ConfigError(
            "fuse_linear_cross_entropy computes lm_head's matmuls itself, which float8 would replace: add lm_head "
            f"to --quantize.linear.float8.filter_fqns {off}"
        )


def check_l2warp(job_config, model_args, degrees: dict[str, int]) -> None:
    """The L2-warp (flame/loss.py) takes each position's largest logit over the whole vocabulary, from the
    objective's logits."""
    if l2warp_factor(model_args, job_config) == 0 or job_config.job.task == "dpo":
        return
    off = "set use_l2warp false in the model config (and drop --training.enable_l2wrap)"
    if degrees["tp"] > 1:
        raise ConfigError(
            f"the L2-warp needs each position's logits over the whole vocabulary, which tensor parallelism shards: "
            f"use tensor_parallel_degree 1 or {off}"
        )
    if degrees["pp"] > 1:
        raise ConfigError(
            "the L2-warp is not applied by the pipeline schedule's loss: use pipeline_parallel_degree 1 or "
            + off
        )


def check_parallelism(job_config, model_args, world_size: int, model=None) -> dict[str, int]:
    """Raise ConfigError (one line) if the job's parallelism cannot run on ``world_size`` ranks with this model;
    return the resolved degrees. ``model``: the model built on the meta device, if the caller has it."""
    degrees = resolved_degrees(job_config.parallelism, world_size)
    if degrees["ep"] > 1 or degrees["etp"] > 1:
        raise ConfigError(
            "expert parallelism needs mixture-of-experts layers, which flame's models do not have; "
            "set expert_parallel_degree and expert_tensor_parallel_degree to 1"
        )
    ddp = degrees["dp_replicate"] > 1 and degrees["dp_shard"] == 1
    if ddp and (degrees["tp"] > 1 or degrees["pp"] > 1):
        raise ConfigError(
            "DDP (data_parallel_replicate_degree > 1 with data_parallel_shard_degree 1) does not combine with "
            "tensor or pipeline parallelism; use data_parallel_shard_degree > 1 (FSDP/HSDP)"
        )
    blocks_per_unit = job_config.parallelism.fsdp_blocks_per_unit
    if not isinstance(blocks_per_unit, int) or isinstance(blocks_per_unit, bool) or blocks_per_unit < 1:
        raise ConfigError(
            f"parallelism.fsdp_blocks_per_unit must be a positive integer, got {blocks_per_unit!r}"
        )
    if job_config.training.enable_cpu_offload and degrees["dp_shard"] == 1:
        raise ConfigError(
            "training.enable_cpu_offload works through FSDP; set data_parallel_shard_degree > 1"
        )
    check_family_support(job_config, model_args, degrees)
    check_fused_loss(job_config, model_args, degrees)
    check_l2warp(job_config, model_args, degrees)
    check_activation_checkpoint(job_config)
    check_compile(job_config.compile, degrees, job_config.training.varlen)
    check_converters(job_config, on_gpu=True)  # the GPU is checked on the ranks
    if degrees["tp"] > 1 and model_args.generic:
        check_generic_tensor_parallel(model_args, degrees["tp"])
    elif degrees["tp"] > 1:
        model = model or meta_model(model_args)
        # Sequence parallelism (off with pipeline parallelism) splits the sequence over the TP ranks.
        seq_len = job_config.training.seq_len if degrees["pp"] == 1 else degrees["tp"]
        check_tensor_parallel(model, degrees["tp"], seq_len)
    if degrees["pp"] > 1:
        check_pipeline_parallel(job_config, model_args)
    if degrees["cp"] > 1:
        from flame.parallelize.context_parallel import check_context_parallel

        check_context_parallel(job_config, model or meta_model(model_args), degrees)
    return degrees


def meta_model(model_args):
    """The model on the meta device, for the checks that read its modules (tensor and context parallelism only:
    torch and the layers are imported for them alone, so a pre-flight without them imports no torch)."""
    import torch

    from flame.models import build_model

    with torch.device("meta"):
        return build_model(model_args)
