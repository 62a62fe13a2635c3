"""The data flags of a job, parsed and checked once when the dataloader is built.

A mixture is written as comma-separated lists: ``training.dataset`` names the datasets and every per-dataset
flag (``dataset_name``, ``dataset_split``, ``data_dir``, ``data_files``, ``text_column``) is either one value
for all of them or one value per dataset, in the same order. Inside one dataset's ``data_files``, ``:`` joins
several files (or glob patterns). Every mistake raises :class:`DataConfigError` with one line naming the flag.
"""

import math
from dataclasses import dataclass

from flame.config.checks import varlen_batch_problem
from flame.errors import FlameError

TRAIN = "train"
# job.task -> what its data rows are
ROW_KINDS = {"pretrain": "text", "sft": "chat", "dpo": "preference"}


class DataConfigError(FlameError, ValueError):
    """A data flag or data file that cannot work; the message is one line saying which and why."""


@dataclass(frozen=True)
class SourceSpec:
    """One dataset of the (possibly one-element) mixture."""

    path: str
    """Hub name, builder name (json, parquet, text, arrow, csv), local directory or file, or prepared-token dir"""
    name: str | None
    split: str
    data_dir: str | None
    data_files: tuple[str, ...] | None
    text_column: str | None
    streaming: bool
    kind: str = "text"
    """What a row is: "text" (one text column), "chat" (a conversation) or "preference" (a prompt and two replies)"""

    def describe(self) -> str:
        details = [f"split={self.split}"]
        if self.name:
            details.append(f"name={self.name}")
        if self.data_dir:
            details.append(f"data_dir={self.data_dir}")
        if self.data_files:
            details.append(f"data_files={':'.join(self.data_files)}")
        return f"dataset '{self.path}' ({', '.join(details)})"


@dataclass(frozen=True)
class DataSpec:
    """Everything the dataloader needs to know about the data of one role (training or evaluation)."""

    sources: tuple[SourceSpec, ...]
    probs: tuple[float, ...]
    batch_size: int
    seq_len: int
    context_len: int
    varlen: bool
    shuffle_buffer: int
    seed: int
    task: str
    """job.task: pretrain, sft or dpo"""
    chat_template: str | None
    shuffle: bool
    """Training data is shuffled and looped forever; evaluation data is read once, in order"""
    infinite: bool


def data_spec(job_config, split: str = TRAIN) -> DataSpec:
    """The DataSpec of a merged JobConfig. ``split="train"`` reads the configured ``training.dataset_split``
    (shuffled, looped forever); any other value is the split to read instead, once and in order."""
    training = job_config.training
    sources = source_specs(
        dataset=training.dataset,
        dataset_name=training.dataset_name,
        dataset_split=training.dataset_split if split == TRAIN else split,
        data_dir=training.data_dir,
        data_files=training.data_files,
        text_column=training.text_column,
        streaming=bool(training.streaming),
        kind=ROW_KINDS[job_config.job.task],
    )
    seq_len = _positive(training.seq_len, "training.seq_len")
    batch_size = _positive(training.local_batch_size, "training.local_batch_size (training.batch_size)")
    context_len = (
        seq_len if training.context_len is None else _positive(training.context_len, "training.context_len")
    )
    if problem := varlen_batch_problem(bool(training.varlen), batch_size):
        raise DataConfigError(problem)
    if context_len > seq_len:
        raise DataConfigError(
            f"training.context_len ({context_len}) must not exceed training.seq_len ({seq_len})"
        )
    if training.shuffle_buffer < 0:
        raise DataConfigError(f"training.shuffle_buffer must be >= 0, got {training.shuffle_buffer}")
    seed = job_config.debug.seed
    return DataSpec(
        sources=sources,
        probs=_probs(training.data_probs, len(sources)),
        batch_size=batch_size,
        seq_len=seq_len,
        context_len=context_len,
        varlen=bool(training.varlen),
        shuffle_buffer=training.shuffle_buffer,
        seed=0 if seed is None else seed,
        task=job_config.job.task,
        chat_template=training.chat_template,
        shuffle=split == TRAIN,
        infinite=split == TRAIN,
    )


def source_specs(
    dataset: str,
    dataset_name: str | None = None,
    dataset_split: str | None = TRAIN,
    data_dir: str | None = None,
    data_files: str | None = None,
    text_column: str | None = None,
    streaming: bool = False,
    kind: str = "text",
) -> tuple[SourceSpec, ...]:
    """The datasets named by the data flags (each a comma-separated list aligned with ``dataset``)."""
    paths = _list(dataset, "dataset")
    if not paths or any(not p for p in paths):
        raise DataConfigError(f"training.dataset must name at least one dataset, got '{dataset}'")
    count = len(paths)
    return tuple(
        SourceSpec(
            path=path,
            name=name,
            split=split or TRAIN,
            data_dir=directory,
            data_files=tuple(f for f in files.split(":") if f) if files else None,
            text_column=column,
            streaming=streaming,
            kind=kind,
        )
        for path, name, split, directory, files, column in zip(
            paths,
            _per_dataset(dataset_name, "dataset_name", count),
            _per_dataset(dataset_split, "dataset_split", count),
            _per_dataset(data_dir, "data_dir", count),
            _per_dataset(data_files, "data_files", count),
            _per_dataset(text_column, "text_column", count),
        )
    )


def _list(value: str | None, flag: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise DataConfigError(f"training.{flag} must be a comma-separated string, got {value!r}")
    return [item.strip() for item in value.split(",")]


def _per_dataset(value: str | None, flag: str, count: int) -> list[str | None]:
    """One value per dataset: a single value is shared, an empty item means the default."""
    items = _list(value, flag)
    if not items:
        return [None] * count
    if len(items) == 1:
        items = items * count
    if len(items) != count:
        raise DataConfigError(
            f"training.{flag} has {len(items)} values for {count} datasets; give one value for all or one per dataset"
        )
    return [item or None for item in items]


def _probs(value: str | None, count: int) -> tuple[float, ...]:
    items = _list(value, "data_probs")
    if not items:
        return tuple([1.0 / count] * count)
    try:
        probs = tuple(float(item) for item in items)
    except ValueError:
        raise DataConfigError(f"training.data_probs must be comma-separated numbers, got '{value}'") from None
    if len(probs) != count:
        raise DataConfigError(
            f"training.data_probs has {len(probs)} values for {count} datasets; give one probability per dataset"
        )
    if any(p < 0 or not math.isfinite(p) for p in probs):
        raise DataConfigError(f"training.data_probs must be finite and >= 0, got '{value}'")
    if not math.isclose(sum(probs), 1.0, abs_tol=1e-6):
        raise DataConfigError(f"training.data_probs must sum to 1, got {sum(probs):.6g} from '{value}'")
    return probs


def _positive(value: int, flag: str) -> int:
    if value is None or value < 1:
        raise DataConfigError(f"{flag} must be >= 1, got {value}")
    return value
