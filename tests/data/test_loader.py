"""build_dataloader end to end: the default job's data, batch layout, per-rank state and exact resume."""

import gzip
import json
import pickle
from collections import Counter

import pytest
import torch

from flame.data import DataConfigError, build_dataloader
from flame.data.tokenize import DocumentEncoder
from tests.data.helpers import (
    BOS,
    CORPUS_DIR,
    EOS,
    assert_same_batches,
    documents_in,
    job_config,
    numbered_texts,
    take,
    write_jsonl,
)


def test_default_job_yields_next_token_batches(tokenizer):
    config = job_config(seq_len=64, batch_size=4)
    assert config.training.dataset == str(CORPUS_DIR)
    inputs, labels = next(iter(build_dataloader(config, tokenizer)))
    assert set(inputs) == {"input"}
    assert inputs["input"].shape == labels.shape == (4, 64)
    assert inputs["input"].dtype == labels.dtype == torch.int64
    # Fixed windows overlap by one token: the labels are the inputs shifted by one.
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
    assert (inputs["input"] == BOS).any()


def test_state_dict_is_keyed_by_dp_rank(tokenizer):
    config = job_config(seq_len=32, batch_size=2)
    loader = build_dataloader(config, tokenizer, dp_rank=1, dp_world_size=2)
    take(loader, 2)
    state = loader.state_dict()
    assert set(state) == {"dp_rank_1", "world_size"} and state["world_size"] == 2
    other_rank = build_dataloader(config, tokenizer, dp_rank=0, dp_world_size=2)
    other_rank.load_state_dict(state)  # not its key: warns, starts fresh
    assert_same_batches(take(other_rank, 2), take(build_dataloader(config, tokenizer, 0, 2), 2))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_yields_the_uninterrupted_batches(tokenizer, num_workers):
    config = job_config("--training.dataloader.num_workers", str(num_workers), seq_len=48, batch_size=3)
    for rank in range(2):
        uninterrupted = take(build_dataloader(config, tokenizer, rank, 2), 9)
        stopped = build_dataloader(config, tokenizer, rank, 2)
        take(stopped, 4)
        checkpoint = pickle.loads(pickle.dumps(stopped.state_dict()))
        resumed = build_dataloader(config, tokenizer, rank, 2)
        resumed.load_state_dict(checkpoint)
        assert_same_batches(uninterrupted[4:], take(resumed, 5))


WORKERS = 2
RANKS = 2


def worker_streams(batches: list, num_workers: int) -> list[list[int]]:
    """The token stream each worker packed: batches come round-robin from the workers, and consecutive fixed
    windows of one worker overlap by one token, so their inputs concatenate to the worker's stream."""
    streams = [[] for _ in range(num_workers)]
    for step, (inputs, _) in enumerate(batches):
        for row in inputs["input"]:
            streams[step % num_workers].extend(row.tolist())
    return streams


@pytest.mark.parametrize("streaming", [False, True])
def test_ranks_and_workers_read_each_document_once_per_epoch(tmp_path, tokenizer, streaming):
    texts = numbered_texts(40)
    write_jsonl(tmp_path / "train.jsonl", texts)
    config = job_config(
        "--training.dataloader.num_workers",
        str(WORKERS),
        dataset=str(tmp_path),
        streaming=streaming,
        shuffle_buffer=8,
        seq_len=32,
        batch_size=2,
    )
    expected = sorted(tuple(d.tokens.tolist()) for d in DocumentEncoder(tokenizer)(texts))
    first_epoch = []
    for rank in range(RANKS):
        batches = take(build_dataloader(config, tokenizer, rank, RANKS), 24)
        for worker, stream in enumerate(worker_streams(batches, WORKERS)):
            shard = rank * WORKERS + worker
            documents = documents_in(stream)
            size = len(range(shard, len(texts), RANKS * WORKERS))
            assert len(documents) > size
            first_epoch += documents[:size]
    assert sorted(first_epoch) == expected


def corpus_with_bad_documents(directory):
    """40 documents plus empty ones, bytes that are not UTF-8 and one very long document."""
    texts = numbered_texts(40)
    texts[5] = texts[17] = ""
    texts[9] = " ".join(numbered_texts(30))  # ~ 600 tokens, many rows long
    lines = [json.dumps({"text": t}).encode() for t in texts]
    lines[12] = b'{"text": "broken \xff\xfe bytes ' + b"w1 " * 10 + b'"}'
    (directory / "train.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))


@pytest.mark.parametrize(
    "streaming, varlen, num_workers",
    [(False, False, 2), (True, False, 2), (False, True, 2), (True, True, 0)],
)
def test_resume_with_two_ranks_across_epochs(tmp_path, tokenizer, streaming, varlen, num_workers):
    corpus_with_bad_documents(tmp_path)
    flags = dict(dataset=str(tmp_path), streaming=streaming, shuffle_buffer=8, seq_len=64, varlen=varlen)
    flags.update(batch_size=1, context_len=24) if varlen else flags.update(batch_size=2)
    config = job_config("--training.dataloader.num_workers", str(num_workers), **flags)
    steps, stops = 40, (11, 23)  # two epochs of each data shard and more; resumed twice (torchtitan#3907)
    stats = Counter()
    for rank in range(RANKS):
        uninterrupted_loader = build_dataloader(config, tokenizer, rank, RANKS)
        uninterrupted = take(uninterrupted_loader, steps)
        loader, step = build_dataloader(config, tokenizer, rank, RANKS), 0
        for stop in stops:
            take(loader, stop - step)
            checkpoint = pickle.loads(pickle.dumps(loader.state_dict()))
            loader, step = build_dataloader(config, tokenizer, rank, RANKS), stop
            loader.load_state_dict(checkpoint)
        assert_same_batches(uninterrupted[step:], take(loader, steps - step))
        stats.update(uninterrupted_loader.data_stats())
    # Every shard is past its first epoch: the bad documents were met and counted.
    assert stats["skipped_empty"] >= 2 and stats["replaced_invalid_utf8"] >= 1
    assert stats["split_long_documents"] >= 1 if varlen else "split_long_documents" not in stats


def test_varlen_batches(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", numbered_texts(40))
    config = job_config(dataset=str(tmp_path), seq_len=128, batch_size=1, varlen=True, context_len=16)
    for inputs, labels in take(build_dataloader(config, tokenizer), 5):
        cu = inputs["cu_seqlens"]
        assert inputs["input"].shape == labels.shape == inputs["position_ids"].shape == (1, 128)
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 128 and (cu[1:] - cu[:-1]).max() <= 16
        assert (labels[0, inputs["input"][0] == EOS] == -100).all()


def test_another_split_is_read_once_in_order(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", numbered_texts(40))
    validation = numbered_texts(6, start=100)
    write_jsonl(tmp_path / "validation.jsonl", validation)
    config = job_config(dataset=str(tmp_path), seq_len=16, batch_size=2)
    batches = list(build_dataloader(config, tokenizer, split="validation"))
    tokens = [t for inputs, _ in batches for row in inputs["input"] for t in row.tolist()]
    encoded = [d.tokens.tolist() for d in DocumentEncoder(tokenizer)(validation)]
    stream = [t for document in encoded for t in document]
    assert len(batches) == (len(stream) - 1) // 16 // 2  # the incomplete last batch is dropped
    assert tokens == stream[: len(tokens)]


def test_more_data_shards_than_documents_fails_at_build(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", numbered_texts(3))
    config = job_config("--training.dataloader.num_workers", "2", dataset=str(tmp_path))
    with pytest.raises(DataConfigError, match="has 3 documents, fewer than its 4 data shards"):
        build_dataloader(config, tokenizer, dp_rank=0, dp_world_size=2)
