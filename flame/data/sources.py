"""Opening one dataset of the mixture: an HF dataset (map-style or streamed) or a prepared token directory.

``training.dataset`` may be

* a directory written by ``python -m flame.data.prepare`` (it holds ``flame_tokens.json``): read from its
  token shards, see :mod:`flame.data.shards`;
* a directory written by datasets' ``save_to_disk`` (a Dataset, or a DatasetDict whose splits are
  ``training.dataset_split``), such as upstream flame's ``utils/reshard.py`` writes: read with ``load_from_disk``,
  which ``load_dataset`` refuses for it;
* a local directory of data files (``datasets.load_dataset(dir)`` infers the format and the splits from the
  file names, e.g. ``train.jsonl.gz`` / ``validation.jsonl.gz``);
* a local file (json/jsonl, parquet, txt, arrow, csv, optionally compressed: .gz, .bz2, .xz, .zst);
* a builder name (``json``, ``parquet``, ``text``, ``arrow``, ``csv``) with ``training.data_files``;
* a hub name, with ``training.dataset_name`` (config) and ``training.dataset_split``.

Text files are read one document per line (the ``text`` builder's default). Bytes that are not UTF-8 in json
and text files are replaced by U+FFFD instead of failing (the tokenizer counts such documents).

Everything that can be checked before training is checked here, in the main process, so that a mistake is
one :class:`DataConfigError` naming the dataset or file: files exist and can be opened and decompressed, the
split exists, the text column exists (``training.text_column``, else ``text``, else ``content``) and holds
strings, and there is at least one row.
"""

import bz2
import glob
import gzip
import lzma
import os
from dataclasses import dataclass

import datasets
from datasets.distributed import split_dataset_by_node

from flame.data.config import DataConfigError, SourceSpec
from flame.data.shards import INDEX_FILE, TokenShards

DEFAULT_TEXT_COLUMNS = ("text", "content")

FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".arrow": "arrow",
    ".csv": "csv",
}
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
COMPRESSIONS = (*OPENERS, ".zst")


def rows_of(batch: dict[str, list], columns: tuple[str, ...]) -> list:
    """The rows of a batch of columns: the values of a single column (texts, conversations), else a dict per row."""
    if len(columns) == 1:
        return batch[columns[0]]
    return [dict(zip(columns, values)) for values in zip(*(batch[c] for c in columns))]


@dataclass
class IndexedTextSource:
    """A map-style HF dataset reduced to the columns a row is read from: random access by row index."""

    dataset: datasets.Dataset
    columns: tuple[str, ...]
    description: str

    @property
    def column(self) -> str:
        return self.columns[0]

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, indices: list[int]) -> list:
        return self.rows(self.dataset[indices])

    def rows(self, batch: dict[str, list]) -> list:
        return rows_of(batch, self.columns)


@dataclass
class StreamedTextSource:
    """A streamed HF dataset reduced to the columns a row is read from."""

    dataset: datasets.IterableDataset
    columns: tuple[str, ...]
    description: str

    @property
    def column(self) -> str:
        return self.columns[0]

    def rows(self, batch: dict[str, list]) -> list:
        return rows_of(batch, self.columns)

    def shard(self, index: int, count: int) -> datasets.IterableDataset:
        """Shard ``index`` of ``count`` disjoint shards covering the stream: whole files when the number of
        files is a multiple of ``count``, else every count-th row."""
        return split_dataset_by_node(self.dataset, rank=index, world_size=count)


Source = IndexedTextSource | StreamedTextSource | TokenShards


def open_source(spec: SourceSpec, tokenizer) -> Source:
    """Open and check one dataset; raises DataConfigError with one line for anything wrong."""
    if os.path.isfile(os.path.join(spec.path, INDEX_FILE)):
        return TokenShards.open(spec.path, spec.split, tokenizer)
    if saved_to_disk(spec.path):
        dataset = _load_saved(spec)
    else:
        files = local_files(spec)
        for path in files:
            check_readable(path, spec)
        dataset = _load(spec, _builder(spec, files))
    if spec.streaming:
        columns = _row_columns(spec, _first_row_columns(dataset, spec), dataset.features)
        return StreamedTextSource(dataset.select_columns(list(columns)), columns, spec.describe())
    if len(dataset) == 0:
        raise DataConfigError(f"{spec.describe()} has no rows")
    columns = _row_columns(spec, dataset.column_names, dataset.features)
    return IndexedTextSource(dataset.select_columns(list(columns)), columns, spec.describe())


def saved_to_disk(path: str) -> bool:
    """A folder that datasets' save_to_disk wrote: a Dataset's (state.json) or a DatasetDict's (dataset_dict.json)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def _load_saved(spec: SourceSpec) -> datasets.Dataset | datasets.IterableDataset:
    """The split of a save_to_disk folder; streamed, one shard per arrow file it holds (the shards that
    dataloader workers and data-parallel ranks divide among themselves)."""
    if spec.data_files or spec.data_dir or spec.name:
        raise DataConfigError(
            f"{spec.describe()} is a save_to_disk folder: it takes no data_files, data_dir or name"
        )
    try:
        saved = datasets.load_from_disk(spec.path)
    except Exception as e:
        raise DataConfigError(f"cannot load {spec.describe()}: {_innermost_message(e)}") from e
    if isinstance(saved, datasets.DatasetDict):
        if spec.split not in saved:
            raise DataConfigError(f"{spec.describe()} has no split '{spec.split}'; it has {', '.join(saved)}")
        saved = saved[spec.split]
    elif spec.split != str(saved.split or datasets.Split.TRAIN):
        raise DataConfigError(
            f"{spec.describe()} is one saved split ('{saved.split or datasets.Split.TRAIN}'), not '{spec.split}'"
        )
    return saved.to_iterable_dataset(num_shards=max(1, len(saved.cache_files))) if spec.streaming else saved


def local_files(spec: SourceSpec) -> list[str]:
    """The local files ``load_dataset`` will read for this dataset ([] for a hub dataset)."""
    if os.path.isfile(spec.path):
        return [spec.path]
    is_directory = os.path.isdir(spec.path)
    if not is_directory and spec.path not in FILE_BUILDERS.values():
        return []  # a hub dataset: its data_files are paths inside the repository
    if spec.data_files:
        files = []
        for pattern in spec.data_files:
            full = os.path.join(spec.path if is_directory else "", pattern)
            matches = sorted(glob.glob(full, recursive=True)) if glob.has_magic(full) else [full]
            if not matches or not all(os.path.exists(m) for m in matches):
                raise DataConfigError(f"data file '{full}' of {spec.describe()} does not exist")
            files.extend(m for m in matches if os.path.isfile(m))
        return files
    if not is_directory:
        raise DataConfigError(f"{spec.describe()} needs training.data_files")
    root = os.path.join(spec.path, spec.data_dir) if spec.data_dir else spec.path
    return sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(root)
        if not os.path.basename(folder).startswith(".")
        for name in names
        if not name.startswith(".") and _file_builder(name)
    )


def check_readable(path: str, spec: SourceSpec) -> None:
    """Open the file and read its first block (decompressed), so that a missing, unreadable or corrupt file
    fails here, by name, instead of inside a dataloader worker."""
    stem, compression = _split_compression(path)
    try:
        if compression == ".zst":
            import zstandard

            with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as f:
                f.read(1 << 16)
        else:
            with OPENERS.get(compression, open)(path, "rb") as f:
                f.read(1 << 16)
        if _file_builder(stem) == "parquet":
            import pyarrow.parquet

            pyarrow.parquet.ParquetFile(path)
    except Exception as e:  # each decompressor and pyarrow raises its own error types
        raise DataConfigError(f"cannot read data file '{path}' of {spec.describe()}: {e}") from e


def _split_compression(path: str) -> tuple[str, str | None]:
    for suffix in COMPRESSIONS:
        if path.endswith(suffix):
            return path[: -len(suffix)], suffix
    return path, None


def _file_builder(name: str) -> str | None:
    stem, _ = _split_compression(name)
    return FILE_BUILDERS.get(os.path.splitext(stem)[1].lower())


def _builder(spec: SourceSpec, files: list[str]) -> str | None:
    """The datasets builder that will read this dataset, when it is known without asking the hub."""
    if spec.path in FILE_BUILDERS.values():
        return spec.path
    builders = {_file_builder(f) for f in files}
    return builders.pop() if len(builders) == 1 else None


def _load(spec: SourceSpec, builder: str | None) -> datasets.Dataset | datasets.IterableDataset:
    if os.path.isfile(spec.path):
        if builder is None:
            raise DataConfigError(
                f"cannot tell the format of data file '{spec.path}' from its name; "
                f"use one of {', '.join(sorted(FILE_BUILDERS))} (optionally compressed: {', '.join(COMPRESSIONS)})"
            )
        path, data_files = builder, [spec.path]
    else:
        path, data_files = spec.path, list(spec.data_files) if spec.data_files else None
    encoding = {}
    if builder == "json":
        # The json reader applies encoding_errors only when the encoding's name differs from "utf-8"; "utf_8" is
        # the same codec under another name, so each chunk is decoded with replacement instead of failing.
        encoding = {"encoding": "utf_8", "encoding_errors": "replace"}
    elif builder == "text":
        encoding = {"encoding_errors": "replace"}
    try:
        return datasets.load_dataset(
            path,
            name=spec.name,
            split=spec.split,
            data_dir=spec.data_dir,
            data_files=data_files,
            streaming=spec.streaming,
            **encoding,
        )
    except Exception as e:
        raise DataConfigError(f"cannot load {spec.describe()}: {_innermost_message(e)}") from e


def _first_row_columns(dataset: datasets.IterableDataset, spec: SourceSpec) -> list[str]:
    try:
        first = next(iter(dataset.take(1)), None)
    except Exception as e:
        raise DataConfigError(f"cannot read {spec.describe()}: {_innermost_message(e)}") from e
    if first is None:
        raise DataConfigError(f"{spec.describe()} has no rows")
    return list(first)


# job.task's data: the columns a row is read from, in order of preference.
ROW_COLUMNS = {
    "chat": (("messages",), ("prompt", "response")),
    "preference": (("prompt", "chosen", "rejected"),),
}


def _row_columns(spec: SourceSpec, columns: list[str], features) -> tuple[str, ...]:
    if spec.kind == "text":
        return (_text_column(spec, columns, features),)
    for wanted in ROW_COLUMNS[spec.kind]:
        if set(wanted) <= set(columns):
            return wanted
    options = " or ".join(" + ".join(f"'{c}'" for c in wanted) for wanted in ROW_COLUMNS[spec.kind])
    raise DataConfigError(
        f"{spec.describe()} has no {spec.kind} columns ({options}); its columns are {', '.join(columns)}"
    )


def _text_column(spec: SourceSpec, columns: list[str], features) -> str:
    candidates = (spec.text_column,) if spec.text_column else DEFAULT_TEXT_COLUMNS
    column = next((c for c in candidates if c in columns), None)
    if column is None:
        wanted = f"text column '{spec.text_column}'" if spec.text_column else "'text' or 'content' column"
        raise DataConfigError(
            f"{spec.describe()} has no {wanted}; its columns are {', '.join(columns)} (set training.text_column)"
        )
    feature = features.get(column) if features else None
    if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataConfigError(f"column '{column}' of {spec.describe()} holds {feature}, not text")
    return column


def _innermost_message(error: BaseException) -> str:
    """The first line of the deepest cause: datasets wraps the useful message in generic ones."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    if isinstance(error, StopIteration):  # the readers' way of finding no row at all
        return "it has no rows"
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
