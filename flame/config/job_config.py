"""flame's additions to torchtitan's JobConfig.

torchtitan merges these sections field by field into its own (``--job.custom_config_module``); flame always
passes this module, so every field below is a regular ``--section.field`` flag and TOML key.

Several fields are the names flame's users already type (``--training.batch_size``, ``--training.compile``,
``--lr_scheduler.lr_min`` ...). They default to ``None`` and, when given (switches too: ``--training.compile
false`` is given), are copied onto torchtitan's field of the same meaning by
:func:`flame.config.manager.resolve_aliases`; ALIASES lists them.

The last block holds upstream flame's option names (fla-org/flame's ``train.sh -h``) that flame spells
differently or does not use: ALIASES maps the first kind, NO_EFFECT gives the notice line for the second, and
``flame.config.manager`` converts the few whose values differ in meaning (UPSTREAM_CONVERTED).
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS = Path(__file__).resolve().parents[1] / "assets"
FLOAT8_CONVERTER = (
    "quantize.linear.float8"  # --model.converters' name for float8 linears (flame/parallelize/float8.py)
)


@dataclass
class Job:
    dump_folder: str = "exp/default"
    """Folder for logs, checkpoints and TensorBoard events of this run"""

    dry_run: bool = False
    """Build the model on the meta device, print the merged config, parameter count and FLOPs per token, exit"""

    custom_config_module: str = "flame.config.job_config"
    """Module whose JobConfig extends torchtitan's (flame's own is always merged)"""

    task: Literal["pretrain", "sft", "dpo"] = "pretrain"
    """pretrain: next-token loss on every token of plain text; sft: chat data (a 'messages' column, or 'prompt' and
    'response'), loss on the assistant's tokens only; dpo: preference pairs ('prompt', 'chosen', 'rejected'),
    the DPO loss against the starting model (see [dpo])"""


@dataclass
class Model:
    config: str = str(ASSETS / "tiny.json")
    """HF-style model config JSON (FLA's config fields; model_type picks the family)"""

    tokenizer_path: str = str(ASSETS / "tokenizer")
    """HF tokenizer directory or hub name"""

    resize_vocab: bool = False
    """If the tokenizer's vocabulary is larger than the model's vocab_size, grow vocab_size to fit it"""

    impl: Literal["auto", "flame", "fla", "hf"] = "auto"
    """Which implementation builds the model: auto (flame's own for transformer, gated_deltanet and delta_net, else
    FLA's class for the model_type, else transformers'), flame, fla (FLA's class) or hf (transformers' own class, or
    a user's registered one); a choice the model_type has no class for stops before launch"""

    attention_backend: Literal["auto", "fla", "flash", "cudnn", "reference"] = "auto"
    """GPU attention kernels: auto (SDPA's own choice for plain causal softmax, FLA's parallel_attn for
    windows/varlen, flame's kernel for softpick/rectified), flash or cudnn (as auto, plain causal softmax pinned to
    SDPA's FlashAttention or cuDNN kernel), fla (FLA's parallel_attn for all softmax attention) or reference
    (materialized PyTorch attention everywhere: slow, O(T^2) memory; for checking numerics)"""


@dataclass
class TrainingDataLoader:
    num_workers: int | None = None
    """Dataloader worker processes per rank; unset: min(4, CPUs per rank - 1) (at least 1) on a GPU, 0 on the CPU"""

    pin_memory: bool | None = None
    """Hand out batches in pinned host memory, so that their copies to the GPU overlap the step; unset: on a GPU"""


@dataclass
class Training:
    dataloader: TrainingDataLoader = field(default_factory=TrainingDataLoader)

    dataset: str = str(ASSETS / "corpus")
    """Dataset(s): hub name, local directory or file type (json, parquet, text, arrow); comma separated for a mix"""

    dataset_name: str | None = None
    """Dataset config name(s), comma separated"""

    dataset_split: str = "train"
    """Split(s), comma separated"""

    data_dir: str | None = None
    """data_dir argument(s) of datasets.load_dataset, comma separated"""

    data_files: str | None = None
    """data_files argument(s) of datasets.load_dataset, comma separated (use ':' to join several files of one dataset)"""

    data_probs: str | None = None
    """Sampling probabilities of the mixed datasets, comma separated, summing to 1"""

    text_column: str | None = None
    """Column holding the text (default: 'text', then 'content')"""

    chat_template: str | None = None
    """Jinja chat template file for job.task sft/dpo (default: the tokenizer's own chat template)"""

    streaming: bool = False
    """Stream the dataset instead of loading it fully"""

    shuffle_buffer: int = 10000
    """Size of the seeded shuffle buffer for streamed datasets"""

    context_len: int | None = None
    """Longest document piece in varlen mode (default: seq_len); longer documents are split"""

    varlen: bool = False
    """Pack documents into one row with cu_seqlens boundaries (batch_size must be 1)"""

    num_workers: int | None = None
    """Dataloader worker processes (alias of training.dataloader.num_workers)"""

    prefetch_factor: int | None = None
    """Batches prefetched per worker (alias of training.dataloader.prefetch_factor)"""

    pin_memory: bool | None = None
    """Batches in pinned host memory (alias of training.dataloader.pin_memory)"""

    persistent_workers: bool | None = None
    """Keep the dataloader workers from one epoch to the next (alias of training.dataloader.persistent_workers)"""

    batch_size: int | None = None
    """Sequences per device per micro-step (alias of training.local_batch_size)"""

    gradient_accumulation_steps: int | None = None
    """Micro-steps per optimizer step (sets global_batch_size = batch_size x accumulation x dp degree)"""

    seed: int | None = None
    """Base RNG seed (alias of debug.seed)"""

    deterministic: bool | None = None
    """Use deterministic algorithms (alias of debug.deterministic)"""

    compile: bool | None = None
    """torch.compile each block (alias of compile.enable)"""

    skip_nan_inf: bool = False
    """Skip the optimizer step when the gradient norm is NaN or Inf, and count it"""

    z_loss: float = 0.0
    """Z-loss coefficient: adds coef x logsumexp(logits)^2, averaged over labelled tokens like the cross-entropy
    (OLMo uses 1e-5); 0 disables"""

    stop_at_step: int | None = None
    """Hard stop: end the run after this step (saving a checkpoint); the LR schedule still spans training.steps"""

    warmup_steps: int | None = None
    """Alias of lr_scheduler.warmup_steps (older flame)"""

    data_parallel_replicate_degree: int | None = None
    """Alias of parallelism.data_parallel_replicate_degree"""

    data_parallel_shard_degree: int | None = None
    """Alias of parallelism.data_parallel_shard_degree"""

    tensor_parallel_degree: int | None = None
    """Alias of parallelism.tensor_parallel_degree"""

    # ---- Surviving preemption and damage (docs/checkpoints.md) ----
    skip_nan_inf_limit: int = 0
    """With training.skip_nan_inf: stop the run (saving nothing new) after this many consecutive skipped steps;
    0: never stop"""

    def attention_context(self) -> int:
        """The most keys a query attends to, for the FLOPs per token: with varlen, a document of at most
        context_len tokens (an upper bound for shorter ones); otherwise the row."""
        if self.varlen and self.context_len:
            return min(self.seq_len, self.context_len)
        return self.seq_len


@dataclass
class Optimizer:
    decay_embeddings: bool = True
    """Apply weight decay to the embeddings (flame's and FLA's recipes; OLMo's exclude them:
    --optimizer.no-decay-embeddings). Norm scales, biases and other parameters below 2 dimensions never decay"""

    scheduler: Literal["wsd", "cosine", "linear"] | None = None
    """Older flame's schedule name: cosine and linear set lr_scheduler.decay_type (decay from the end of warmup),
    wsd keeps the LR stable until the last lr_scheduler.decay_ratio of the steps (default 0.1)"""

    min_lr_ratio: float | None = None
    """Alias of lr_scheduler.min_lr_factor (older flame)"""

    fused: bool | None = None
    """Older flame's switch: true sets optimizer.implementation fused (the default), false foreach"""

    muon_momentum: float = 0.95
    """optimizer.name Muon: momentum of the blocks' matrices (Nesterov)"""

    muon_ns_iterations: int = 5
    """optimizer.name Muon: Newton-Schulz iterations per orthogonalisation"""

    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """optimizer.name Muon: dtype of the Newton-Schulz iteration"""


@dataclass
class LRScheduler:
    lr_min: float | None = None
    """Final learning rate as a fraction of the peak (alias of lr_scheduler.min_lr_factor)"""


@dataclass
class Checkpoint:
    enable: bool = True
    """Save DCP checkpoints under <dump_folder>/<folder>"""

    keep_latest_k: int = 0
    """Keep only the latest k complete checkpoints; 0 (the default, as upstream flame) keeps all"""

    last_save_model_only: bool = False
    """Save only the model at the last step (no optimizer/data state: the run cannot resume from it)"""

    # ---- Surviving preemption and damage (docs/checkpoints.md) ----
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make every rank finish its step, save a checkpoint and exit with status 75 (empty: none)"""

    preempt_timeout: float = 0.0
    """Seconds after a preemption signal after which the run exits without finishing its save (0: no limit)"""

    verify_checksums: bool = True
    """Check the SHA-256 of every file of a checkpoint before resuming from it (sizes are always checked)"""

    convert_to_hf_on_save: bool = False
    """Export every checkpoint to an HF folder beside it, <checkpoint folder>/step-<N>-hf (checkpoint.export_dtype),
    from a background thread on rank 0; keep_latest_k removes it with its checkpoint (the softpick fork's flag)"""

    # ---- Hub upload, with the softpick fork's flag names (docs/checkpoints.md) ----
    hf_upload_enabled: bool = False
    """Upload every checkpoint to the hub repository checkpoint.hf_repo_base_name as a step-<N>/ folder, from a
    background thread on rank 0 (needs a write token: HF_TOKEN or `hf auth login`)"""

    hf_repo_base_name: str | None = None
    """Hub repository of the uploads, 'user/name' (created if missing; a resumed run keeps adding to it)"""

    hf_upload_format: Literal["dcp", "hf"] = "dcp"
    """What is uploaded per step: dcp (the checkpoint folder, which resumes) or hf (an HF export of it in
    checkpoint.export_dtype, which transformers loads)"""

    hf_repo_private: bool = False
    """Create the hub repository private (default: the hub's default visibility, public for a user, as the fork)"""

    hf_upload_timeout: float = 600.0
    """Seconds the end of a run waits for uploads still queued; what is left is named and uploaded by the next
    launch (after a preemption signal the run does not wait)"""


@dataclass
class Metrics:
    enable_tensorboard: bool = True
    """Write TensorBoard event files under <dump_folder>/<save_tb_folder>"""

    enable_wandb: bool = False
    """Log to Weights & Biases (pip install 'flame[wandb]'); project $WANDB_PROJECT (default flame), run name
    $WANDB_NAME (default: the dump folder's name); WANDB_MODE=offline needs no network"""


@dataclass
class Validation:
    freq: int = 100
    """Validate every freq steps (and at the last step)"""

    dataset: str | None = None
    """Dataset to validate on (default: the training dataset(s), read at validation.split)"""

    dataset_name: str | None = None
    """Config name of validation.dataset"""

    split: str = "validation"
    """Split read (once, in order) for validation"""

    local_batch_size: int | None = None
    """Sequences per device per validation step (default: training.local_batch_size)"""

    seq_len: int | None = None
    """Tokens per validation sequence (default: training.seq_len)"""

    def __post_init__(self):
        pass  # replaces torchtitan's assert on steps: flame.config.checks reports bad values in one line


@dataclass
class Inference:
    interval: int = 0
    """Generate text from inference.prompt every interval steps and log it (0: never)"""

    prompt: str = "The"
    """Prompt(s) for the text samples; separate several with '|'"""

    max_new_tokens: int = 32
    """Tokens generated per prompt"""

    temperature: float = 0.0
    """Sampling temperature; 0 is greedy decoding"""

    top_k: int = 0
    """Sample among the top_k most likely tokens (0: all)"""


@dataclass
class Eval:
    interval: int = 0
    """Evaluate with lm-evaluation-harness every interval steps and at the last step (0: never): rank 0 exports
    the current weights and runs eval.tasks as python -m flame.eval does; docs/evaluation.md"""

    tasks: str = ""
    """lm-eval task names, comma separated (flame_corpus_last_word is shipped with flame and runs offline)"""

    include_path: str = ""
    """Folders of task YAMLs to search besides lm-eval's tasks and flame's, comma separated"""

    limit: float = 0
    """Examples per task (a fraction below 1); 0: all"""

    batch_size: int = 8
    """Examples per forward of the evaluated model"""


@dataclass
class Debug:
    enable: bool = False
    """Debug mode: CUDA_LAUNCH_BLOCKING=1 (a CUDA error points at the failing kernel) and autograd anomaly
    detection (names the op that produced a NaN in backward); slow"""


@dataclass
class Parallelism:
    fsdp_blocks_per_unit: int = 1
    """Consecutive blocks that FSDP shards as one unit (one all-gather and one reduce-scatter for them all). FSDP's
    hooks cost host time per unit, which bounds the step of a small model on several GPUs (docs/performance.md,
    "What holds FSDP back"); fewer, larger units cost less host time and keep more parameters gathered at once"""


@dataclass
class Compile:
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """inductor's mode for the compiled blocks and loss: reduce-overhead replays each compiled block as a CUDA graph
    (no per-kernel launch work on the host; the shapes must stay fixed), max-autotune also benchmarks inductor's
    matmul and kernel choices (long first steps); the loss compiles without CUDA graphs; inductor backend only; the
    CUDA graph modes with one GPU or DDP, not FSDP nor packed documents (docs/performance.md, "CUDA graphs")"""

    graph_eager_blocks: bool = True
    """Blocks that torch.compile leaves eager (FLA's classes) replay as CUDA graphs, captured beside the first
    training forward (which runs eagerly) and replayed from the second: one GPU, no activation checkpointing or
    offloading; a step's first micro-batch replays, other calls (later micro-batches, evaluation, another shape,
    blocks given integer tensors such as packed documents' boundaries) run eagerly (docs/performance.md, "FLA
    classes, compiled and eager")"""

    compile_graphed_blocks: bool = True
    """The CUDA graphs of ``graph_eager_blocks`` capture the blocks compiled: inductor fuses their elementwise work
    around FLA's kernels, and the compiled regions' guards, which made compiled FLA blocks slower than eager ones,
    run only while capturing (a block that fails compiled is captured uncompiled, with one log line)"""

    graph_compiled_blocks: bool = True
    """flame's families' compiled blocks replay as CUDA graphs too, captured beside the first training forward, so
    that the host issues each block's forward and backward as one launch instead of the compiled block's kernels and
    its custom ops' Python (FLA's op wrappers): one GPU, compile.mode default or max-autotune-no-cudagraphs, no packed
    documents, activation checkpointing or offloading; a step's first micro-batch replays, other calls (later
    micro-batches, evaluation, another shape) run the compiled blocks, and a capture that fails leaves them running
    without graphs, with one log line (docs/performance.md, "CUDA graphs")"""


@dataclass
class ActivationCheckpoint:
    mode: Literal["selective", "full", "memory_budget", "none"] = "none"
    """Activation checkpointing: none, selective, full or memory_budget"""

    chunk_states: Literal["auto", "recompute", "save"] = "auto"
    """The gated and plain delta rules on FLA's kernels: recompute runs the forward's state recurrence again in the
    backward (FLA's way), save keeps its results for the backward instead (per layer B x T/64 x value heads x K x V values,
    plus B x T x value heads x (K + V), in the activation dtype: 10.8 GiB more for gated_deltanet_340M at 8 x 2048),
    which is faster where the GPU, not the host, bounds the step; auto saves them where the blocks replay as CUDA
    graphs (compile.mode reduce-overhead) and recomputes them elsewhere; packed documents (varlen) always recompute
    (docs/performance.md, "Chunk states")"""


@dataclass
class ActivationOffload:
    mode: Literal["none", "full"] = "none"
    """full: keep what each block saves for backward in pinned host memory, copied on a side CUDA stream while
    the GPU computes (upstream flame's option; with activation_checkpoint.mode full it offloads the blocks'
    inputs)"""


@dataclass
class Experimental:
    custom_model_path: str = ""
    """Your model's module, imported before the model is built: a package folder, a .py file or a dotted module
    name (registers its classes with transformers' AutoConfig/AutoModelForCausalLM; docs/models.md)"""

    custom_import: str = ""
    """Another module (dotted name) imported before the model is built, as custom_model_path"""


@dataclass
class DPO:
    beta: float = 0.1
    """Strength of the pull towards the reference model (the starting weights)"""

    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: -log sigmoid(beta x margin) (Rafailov et al. 2023); ipo: (margin - 1 / (2 beta))^2 with
    length-averaged log-probabilities (Azar et al. 2023)"""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    activation_offload: ActivationOffload = field(default_factory=ActivationOffload)
    validation: Validation = field(default_factory=Validation)
    inference: Inference = field(default_factory=Inference)
    eval: Eval = field(default_factory=Eval)
    debug: Debug = field(default_factory=Debug)
    dpo: DPO = field(default_factory=DPO)
    experimental: Experimental = field(default_factory=Experimental)


# flame flag -> torchtitan field it sets (when the flame flag is given).
ALIASES: dict[str, str] = {
    "training.batch_size": "training.local_batch_size",
    "training.num_workers": "training.dataloader.num_workers",
    "training.prefetch_factor": "training.dataloader.prefetch_factor",
    "training.pin_memory": "training.dataloader.pin_memory",
    "training.persistent_workers": "training.dataloader.persistent_workers",
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "training.compile": "compile.enable",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "optimizer.min_lr_ratio": "lr_scheduler.min_lr_factor",
}


# ---------------------------------------------------------------------------------------------------------------
# Upstream flame's option names (fla-org/flame's `train.sh -h`, older and current), accepted so that its commands
# and TOML files run verbatim. Renames are in ALIASES, options without an effect here in NO_EFFECT, and the ones
# whose values need converting in flame.config.manager (UPSTREAM_CONVERTED). Switches are `bool | None`: None
# means not given, so `--x false` reaches the field it sets.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class UpstreamJob:
    print_args: bool | None = None
    """Upstream's name of job.print_config: print the merged config at launch"""

    use_for_integration_test: bool = False
    """Upstream's torchtitan test-suite marker (no effect in flame)"""


@dataclass
class UpstreamModel:
    name: str | None = None
    """Upstream's model registry name, e.g. 'fla' (no effect: flame picks the family from model_type in model.config)"""

    norm_type: str | None = None
    """Upstream's norm choice (no effect: the norm comes from the model config)"""


@dataclass
class UpstreamTraining:
    disable_loss_parallel: bool | None = None
    """Upstream's name of parallelism.disable_loss_parallel"""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] | None = None
    """Upstream's name of parallelism.fsdp_reshard_after_forward"""

    enable_l2wrap: bool = False
    """L2Wrap on the logits for any model, as the model config's use_l2warp (FLA's key) turns it on"""

    l2wrap_factor: float | None = None
    """L2Wrap's strength (default FLA's 1e-4)"""


@dataclass
class UpstreamMetrics:
    rank_0_only: bool | None = None
    """Upstream's switch: metrics from rank 0 only (the default); false sets metrics.save_for_all_ranks"""


@dataclass
class UpstreamCheckpoint:
    enable_checkpoint: bool | None = None
    """Upstream's name of checkpoint.enable"""

    interval_type: Literal["step", "steps", "seconds"] | None = None
    """Upstream's interval unit: flame counts checkpoint.interval in steps ('seconds' is refused)"""

    model_weights_only: bool | None = None
    """Upstream's name of checkpoint.last_save_model_only"""

    last_save_model_weights_only: bool | None = None
    """Upstream's newer name of checkpoint.last_save_model_only"""

    initial_load_model_weights_only: bool | None = None
    """Upstream's name of checkpoint.initial_load_model_only"""


@dataclass
class UpstreamExperimental:
    pipeline_parallel_degree: int | None = None
    """Upstream's name of parallelism.pipeline_parallel_degree"""

    pipeline_parallel_schedule: str | None = None
    """Upstream's name of parallelism.pipeline_parallel_schedule"""

    pipeline_parallel_schedule_csv: str | None = None
    """Upstream's name of parallelism.pipeline_parallel_schedule_csv"""

    pipeline_parallel_microbatches: int | None = None
    """Upstream's number of pipeline micro-batches per step (sets parallelism.pipeline_parallel_microbatch_size =
    training.local_batch_size / this)"""

    pipeline_parallel_split_points: list[str] | None = None
    """Upstream's stage boundaries (no effect: flame splits the layers evenly, see
    parallelism.pipeline_parallel_layers_per_stage)"""

    context_parallel_degree: int | None = None
    """Upstream's name of parallelism.context_parallel_degree"""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] | None = None
    """Upstream's ring-attention collective (no effect: flame's context parallelism gathers keys and states)"""

    enable_async_tensor_parallel: bool = False
    """Upstream's async TP switch (no effect in flame)"""

    enable_compiled_autograd: bool = False
    """Upstream's compiled-autograd switch (no effect in flame)"""


@dataclass
class UpstreamFloat8:
    enable_float8_linear: bool | None = None
    """Upstream's float8 switch: adds quantize.linear.float8 to model.converters"""

    enable_fsdp_float8_all_gather: bool | None = None
    """Upstream's name of quantize.linear.float8.enable_fsdp_float8_all_gather"""

    precompute_float8_dynamic_scale_for_fsdp: bool | None = None
    """Upstream's name of quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """Upstream's name of quantize.linear.float8.recipe_name"""

    force_recompute_fp8_weight_in_bwd: bool = False
    """Upstream's float8 recompute switch (no effect: torchao decides)"""

    scaling_type_input: Literal["dynamic", "delayed"] | None = None
    """Upstream's float8 scaling of inputs: dynamic is what flame does ('delayed' is refused)"""

    scaling_type_weight: Literal["dynamic", "delayed"] | None = None
    """Upstream's float8 scaling of weights: dynamic is what flame does ('delayed' is refused)"""

    scaling_type_grad_output: Literal["dynamic", "delayed"] | None = None
    """Upstream's float8 scaling of output gradients: dynamic is what flame does ('delayed' is refused)"""


@dataclass
class UpstreamMemoryEstimation:
    enabled: bool = False
    """Upstream's FSDP memory estimation switch (no effect in flame)"""


@dataclass
class UpstreamJobConfig:
    job: UpstreamJob = field(default_factory=UpstreamJob)
    model: UpstreamModel = field(default_factory=UpstreamModel)
    training: UpstreamTraining = field(default_factory=UpstreamTraining)
    metrics: UpstreamMetrics = field(default_factory=UpstreamMetrics)
    checkpoint: UpstreamCheckpoint = field(default_factory=UpstreamCheckpoint)
    experimental: UpstreamExperimental = field(default_factory=UpstreamExperimental)
    float8: UpstreamFloat8 = field(default_factory=UpstreamFloat8)
    memory_estimation: UpstreamMemoryEstimation = field(default_factory=UpstreamMemoryEstimation)


ALIASES.update(
    {
        "job.print_args": "job.print_config",
        "training.disable_loss_parallel": "parallelism.disable_loss_parallel",
        "training.fsdp_reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
        "checkpoint.enable_checkpoint": "checkpoint.enable",
        "checkpoint.model_weights_only": "checkpoint.last_save_model_only",
        "checkpoint.last_save_model_weights_only": "checkpoint.last_save_model_only",
        "checkpoint.initial_load_model_weights_only": "checkpoint.initial_load_model_only",
        "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
        "experimental.pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
        "experimental.pipeline_parallel_schedule_csv": "parallelism.pipeline_parallel_schedule_csv",
        "experimental.context_parallel_degree": "parallelism.context_parallel_degree",
        "float8.enable_fsdp_float8_all_gather": "quantize.linear.float8.enable_fsdp_float8_all_gather",
        "float8.precompute_float8_dynamic_scale_for_fsdp": "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
        "float8.recipe_name": "quantize.linear.float8.recipe_name",
    }
)

# Upstream option -> why it changes nothing here; given with a value other than its default, the launch prints
# "notice: --<option> has no effect in flame: <reason>".
NO_EFFECT: dict[str, str] = {
    "job.use_for_integration_test": "it marks torchtitan's own integration tests",
    "model.name": "the model family comes from model_type in --model.config",
    "model.norm_type": "the norm comes from the model config (--model.config)",
    "experimental.pipeline_parallel_split_points": (
        "flame splits the layers evenly between stages (--parallelism.pipeline_parallel_layers_per_stage)"
    ),
    "experimental.context_parallel_rotate_method": "flame's context parallelism all-gathers keys and states",
    "experimental.enable_async_tensor_parallel": "flame's tensor parallelism is synchronous",
    "experimental.enable_compiled_autograd": "flame compiles the forward of each block only",
    "float8.force_recompute_fp8_weight_in_bwd": "torchao's float8 training decides what to recompute",
    "memory_estimation.enabled": "flame has no FSDP memory estimator; the first steps' logged memory is the measure",
    "memory_estimation.enable": "flame has no FSDP memory estimator",
    "model.print_after_conversion": "flame logs the model's size, not its definition",
    "fault_tolerance.enable": "flame does not run TorchFT",
    "memory_estimation.disable_fake_mode": "flame has no FSDP memory estimator",
}
