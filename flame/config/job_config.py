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

    data_parallel_replicate_degree: int | None = None
    """Alias of parallelism.data_parallel_replicate_degree"""

    data_parallel_shard_degree: int | None = None
    """Alias of parallelism.data_parallel_shard_degree"""

    tensor_parallel_degree: int | None = None
    """Alias of parallelism.tensor_parallel_degree"""


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


@dataclass
class Metrics:
    enable_tensorboard: bool = True
    """Write TensorBoard event files under <dump_folder>/<save_tb_folder>"""


@dataclass
class ActivationCheckpoint:
    mode: Literal["selective", "full", "memory_budget", "none"] = "none"
    """Activation checkpointing: none, selective, full or memory_budget"""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)


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
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
}
