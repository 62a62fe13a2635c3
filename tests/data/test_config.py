"""Data flags: per-dataset lists, probabilities and packing options fail at build time with one clear line."""

import pytest

from flame.data import DataConfigError
from flame.data.config import data_spec
from tests.data.helpers import job_config


def test_per_dataset_flags_align_with_datasets():
    spec = data_spec(
        job_config(
            dataset="json,parquet",
            data_files="a.jsonl:b/*.jsonl,c.parquet",
            dataset_split="train,dev",
            dataset_name="en",
            data_probs="0.25,0.75",
        )
    )
    first, second = spec.sources
    assert (first.path, first.data_files, first.split, first.name) == (
        "json",
        ("a.jsonl", "b/*.jsonl"),
        "train",
        "en",
    )
    assert (second.path, second.data_files, second.split, second.name) == (
        "parquet",
        ("c.parquet",),
        "dev",
        "en",
    )
    assert spec.probs == (0.25, 0.75)


def test_defaults():
    spec = data_spec(job_config(seq_len=64))
    assert spec.probs == (1.0,)
    assert spec.seed == 0 and spec.context_len == 64
    assert spec.shuffle and spec.infinite
    assert data_spec(job_config("--debug.seed", "7", seq_len=64, data_probs="1")).seed == 7


def test_another_split_is_read_once_in_order():
    spec = data_spec(job_config(dataset="a,b", dataset_split="train,train"), split="validation")
    assert [s.split for s in spec.sources] == ["validation", "validation"]
    assert not spec.shuffle and not spec.infinite
    assert spec.probs == (0.5, 0.5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(dataset="a,b", data_probs="0.5,0.3,0.2"), "data_probs has 3 values for 2 datasets"),
        (dict(dataset="a,b", data_probs="0.5,0.4"), "must sum to 1, got 0.9"),
        (dict(dataset="a,b", data_probs="1.5,-0.5"), "finite and >= 0"),
        (dict(dataset="a,b", data_probs="half,half"), "comma-separated numbers"),
        (dict(dataset="a,b,c", dataset_split="train,dev"), "dataset_split has 2 values for 3 datasets"),
        (dict(dataset="a,,b"), "at least one dataset"),
        (dict(varlen=True, batch_size=2), "batch_size must be 1"),
        (dict(seq_len=64, context_len=128), "must not exceed training.seq_len"),
        (dict(shuffle_buffer=-1), "shuffle_buffer must be >= 0"),
    ],
)
def test_mistakes_raise_one_line(flags, message):
    with pytest.raises(DataConfigError, match=message) as error:
        data_spec(job_config(**flags))
    assert isinstance(error.value, ValueError)
    assert "\n" not in str(error.value)
