"""Opening datasets: every local format, directories, builders, hub names (with a stand-in loader), the text
column, and clear one-line errors for unreadable files and missing columns or splits."""

import gzip

import datasets
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet
import pytest

from flame.data import DataConfigError
from flame.data.config import source_specs
from flame.data.sources import IndexedTextSource, StreamedTextSource, open_source
from tests.data.helpers import numbered_texts, write_jsonl

TEXTS = numbered_texts(6)


def all_texts(source) -> list[str]:
    if isinstance(source, IndexedTextSource):
        return source.read(list(range(len(source))))
    return [row[source.column] for row in source.dataset]


def open_one(tokenizer, dataset, **flags):
    (spec,) = source_specs(dataset, **flags)
    return open_source(spec, tokenizer)


def write_file(directory, kind: str):
    if kind in ("jsonl", "json.gz"):
        return write_jsonl(directory / f"data.{kind}", TEXTS)
    table = pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))})
    if kind == "parquet":
        path = directory / "data.parquet"
        pyarrow.parquet.write_table(table, path)
    elif kind == "arrow":
        path = directory / "data.arrow"
        with pyarrow.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    elif kind == "txt.gz":
        path = directory / "data.txt.gz"
        path.write_bytes(gzip.compress("\n".join(TEXTS).encode()))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json.gz", "parquet", "arrow", "txt.gz"])
@pytest.mark.parametrize("streaming", [False, True])
def test_local_files_by_path_and_by_builder(tmp_path, tokenizer, kind, streaming):
    path = write_file(tmp_path, kind)
    by_path = open_one(tokenizer, str(path), streaming=streaming)
    assert isinstance(by_path, StreamedTextSource if streaming else IndexedTextSource)
    assert all_texts(by_path) == TEXTS
    builder = {"jsonl": "json", "json.gz": "json", "txt.gz": "text"}.get(kind, kind)
    by_builder = open_one(tokenizer, builder, data_files=str(path), streaming=streaming)
    assert all_texts(by_builder) == TEXTS


def test_directory_splits_and_glob_data_files(tmp_path, tokenizer):
    write_jsonl(tmp_path / "corpus" / "train.jsonl.gz", TEXTS[:4])
    write_jsonl(tmp_path / "corpus" / "validation.jsonl.gz", TEXTS[4:])
    corpus = str(tmp_path / "corpus")
    assert all_texts(open_one(tokenizer, corpus)) == TEXTS[:4]
    assert all_texts(open_one(tokenizer, corpus, dataset_split="validation", streaming=True)) == TEXTS[4:]
    assert sorted(all_texts(open_one(tokenizer, "json", data_files=f"{corpus}/*.jsonl.gz"))) == sorted(TEXTS)


def test_text_column_defaults_to_content_and_can_be_chosen(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "code.jsonl", TEXTS, column="content")
    assert open_one(tokenizer, str(path)).column == "content"
    assert all_texts(open_one(tokenizer, str(path), text_column="content", streaming=True)) == TEXTS


@pytest.mark.parametrize("streaming", [False, True])
def test_missing_text_column_lists_the_columns(tmp_path, tokenizer, streaming):
    path = write_jsonl(tmp_path / "data.jsonl", TEXTS, column="body")
    with pytest.raises(DataConfigError, match="has no 'text' or 'content' column; its columns are body, id"):
        open_one(tokenizer, str(path), streaming=streaming)
    with pytest.raises(DataConfigError, match="no text column 'txt'; its columns are body, id"):
        open_one(tokenizer, str(path), text_column="txt", streaming=streaming)


def test_non_text_column_is_refused(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [1, 2, 3])
    with pytest.raises(DataConfigError, match="column 'text' .* holds Value.*int64.*, not text"):
        open_one(tokenizer, str(path))


@pytest.mark.parametrize("streaming", [False, True])
def test_bytes_that_are_not_utf8_are_replaced(tmp_path, tokenizer, streaming):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": "bad \xff\xfe here"}\n'))
    assert all_texts(open_one(tokenizer, str(path), streaming=streaming)) == ["ok", "bad \ufffd\ufffd here"]


@pytest.mark.parametrize("streaming", [False, True])
def test_unreadable_file_is_named(tmp_path, tokenizer, streaming):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", TEXTS)
    corrupt = tmp_path / "corpus" / "b.jsonl.gz"
    corrupt.write_bytes(b"this is not gzip")
    with pytest.raises(DataConfigError, match=f"cannot read data file '{corrupt}'") as error:
        open_one(tokenizer, str(tmp_path / "corpus"), streaming=streaming)
    assert "\n" not in str(error.value)
    with pytest.raises(DataConfigError, match="data file '.*missing.jsonl' .* does not exist"):
        open_one(tokenizer, "json", data_files=str(tmp_path / "missing.jsonl"))


def test_missing_split_and_empty_dataset(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", TEXTS)
    with pytest.raises(DataConfigError, match="cannot load dataset .*split=test.*Unknown split"):
        open_one(tokenizer, str(path), dataset_split="test")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for streaming in (False, True):
        with pytest.raises(DataConfigError, match="empty.jsonl.*has no rows"):
            open_one(tokenizer, str(empty), streaming=streaming)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_save_to_disk_folder_is_read_whole(tmp_path, tokenizer, streaming):
    # As upstream flame's utils/reshard.py writes one: Dataset.save_to_disk(folder, num_shards=N).
    datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(
        tmp_path, num_shards=3
    )
    source = open_one(tokenizer, str(tmp_path), streaming=streaming)
    assert isinstance(source, StreamedTextSource if streaming else IndexedTextSource)
    assert all_texts(source) == TEXTS
    if streaming:
        assert source.dataset.num_shards == 3  # what the workers and ranks divide
    with pytest.raises(DataConfigError, match=r"is one saved split \('train'\), not 'validation'$"):
        open_one(tokenizer, str(tmp_path), dataset_split="validation")
    with pytest.raises(
        DataConfigError, match="is a save_to_disk folder: it takes no data_files, data_dir or name$"
    ):
        open_one(tokenizer, str(tmp_path), data_files="x.arrow")


def test_a_saved_dataset_dict_gives_its_splits(tmp_path, tokenizer):
    splits = {"train": TEXTS[:4], "validation": TEXTS[4:]}
    datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
    ).save_to_disk(tmp_path)
    for split, texts in splits.items():
        assert all_texts(open_one(tokenizer, str(tmp_path), dataset_split=split)) == texts
    with pytest.raises(DataConfigError, match="has no split 'test'; it has train, validation$"):
        open_one(tokenizer, str(tmp_path), dataset_split="test")


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_name_passes_config_name_split_and_streaming(tmp_path, tokenizer, monkeypatch, streaming):
    calls = []
    local = datasets.Dataset.from_dict({"text": TEXTS})

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return local.to_iterable_dataset() if kwargs["streaming"] else local

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    source = open_one(
        tokenizer, "org/corpus", dataset_name="en", dataset_split="validation", streaming=streaming
    )
    assert all_texts(source) == TEXTS
    assert calls == [
        (
            "org/corpus",
            dict(name="en", split="validation", data_dir=None, data_files=None, streaming=streaming),
        )
    ]
