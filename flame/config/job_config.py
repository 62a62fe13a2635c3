"""flame's additions to torchtitan's JobConfig.

torchtitan merges these sections field by field into its own (``--job.custom_config_module``); flame always
passes this module, so every field below is a regular ``--section.field`` flag and TOML key.

Several fields are the names flame's users already type (``--training.batch_size``, ``--training.compile``,
``--lr_scheduler.lr_min`` ...). They default to ``None`` (switches: ``False``) and, when given, are copied onto
torchtitan's field of the same meaning by :func:`flame.config.manager.resolve_aliases`; ALIASES lists them.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS = Path(__file__).resolve().parents[1] / "assets"


@dataclass
class Job:
    dump_folder: str = "exp/default"
    """Folder for logs, checkpoints and TensorBoard events of this run"""

    dry_run: bool = False
    """Build the model on the meta device, print the merged config, parameter count and FLOPs per token, exit"""

    custom_config_module: str = "flame.config.job_config"
    """Module whose JobConfig extends torchtitan's (flame's own is always merged)"""


@dataclass
class Model:
    config: str = str(ASSETS / "tiny.json")
    """HF-style model config JSON (FLA's config fields; model_type picks the family)"""

    tokenizer_path: str = str(ASSETS / "tokenizer")
    """HF tokenizer directory or hub name"""

    resize_vocab: bool = False
    """If the tokenizer's vocabulary is larger than the model's vocab_size, grow vocab_size to fit it"""

    attention_backend: str = "auto"
    """GPU attention kernels: auto (SDPA's own choice for plain causal softmax, FLA's parallel_attn for
    windows/varlen, flame's kernel for softpick/rectified), flash or cudnn (as auto, plain causal softmax pinned to
    SDPA's FlashAttention or cuDNN kernel), fla (FLA's parallel_attn for all softmax attention) or reference
    (materialized PyTorch attention everywhere: slow, O(T^2) memory; for checking numerics)"""


@dataclass
class Training:
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

    batch_size: int | None = None
    """Sequences per device per micro-step (alias of training.local_batch_size)"""

    gradient_accumulation_steps: int | None = None
    """Micro-steps per optimizer step (sets global_batch_size = batch_size x accumulation x dp degree)"""

    seed: int | None = None
    """Base RNG seed (alias of debug.seed)"""

    deterministic: bool = False
    """Use deterministic algorithms (alias of debug.deterministic)"""

    compile: bool = False
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

    fused: bool = False
    """Older flame's switch for optimizer.implementation = fused (already the default)"""


@dataclass
class LRScheduler:
    lr_min: float | None = None
    """Final learning rate as a fraction of the peak (alias of lr_scheduler.min_lr_factor)"""


@dataclass
class Checkpoint:
    enable: bool = True
    """Save DCP checkpoints under <dump_folder>/<folder>"""

    keep_latest_k: int = 2
    """Keep only the latest k checkpoints (0: keep all)"""

    last_save_model_only: bool = False
    """Save only the model at the last step (no optimizer/data state: the run cannot resume from it)"""

    # ---- Surviving preemption and damage (docs/checkpoints.md) ----
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make every rank finish its step, save a checkpoint and exit with status 75 (empty: none)"""

    preempt_timeout: float = 0.0
    """Seconds after a preemption signal after which the run exits without finishing its save (0: no limit)"""

    verify_checksums: bool = True
    """Check the SHA-256 of every file of a checkpoint before resuming from it (sizes are always checked)"""


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
class Debug:
    enable: bool = False
    """Debug mode: CUDA_LAUNCH_BLOCKING=1 (a CUDA error points at the failing kernel) and autograd anomaly
    detection (names the op that produced a NaN in backward); slow"""


@dataclass
class ActivationCheckpoint:
    mode: Literal["selective", "full", "memory_budget", "none"] = "none"
    """Activation checkpointing: none, selective, full or memory_budget"""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    validation: Validation = field(default_factory=Validation)
    inference: Inference = field(default_factory=Inference)
    debug: Debug = field(default_factory=Debug)


# flame flag -> torchtitan field it sets (when the flame flag is given).
ALIASES: dict[str, str] = {
    "training.batch_size": "training.local_batch_size",
    "training.num_workers": "training.dataloader.num_workers",
    "training.prefetch_factor": "training.dataloader.prefetch_factor",
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
