"""The prepared-token format: writing shards and the index, reading documents back, refusing mismatches."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from flame.data import DataConfigError
from flame.data.shards import INDEX_FILE, ShardWriter, TokenShards, token_dtype


class StubTokenizer(SimpleNamespace):
    def __len__(self):
        return self.vocab_size


BIG_VOCAB = StubTokenizer(name_or_path="big", vocab_size=100_000, bos_token_id=1, eos_token_id=2)


def test_token_dtype_follows_the_vocabulary_size():
    assert token_dtype(4096) == np.uint16 and token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32


def test_documents_round_trip_through_shards(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 100_000, size=n).astype(np.int32) for n in rng.integers(1, 50, size=40)]
    writer = ShardWriter(str(tmp_path), "train", BIG_VOCAB, shard_tokens=200, source="test")
    for document in documents:
        writer.add(document)
    entry = writer.finish({"skipped_empty": 3})
    assert entry["documents"] == 40 and entry["tokens"] == sum(len(d) for d in documents)
    assert len(entry["shards"]) > 3 and all(s["tokens"] >= 200 for s in entry["shards"][:-1])
    assert (tmp_path / entry["shards"][0]["file"]).stat().st_size == 4 * entry["shards"][0][
        "tokens"
    ]  # uint32
    shards = TokenShards.open(str(tmp_path), "train", BIG_VOCAB)
    assert len(shards) == 40
    order = [7, 0, 39, 12, 13]
    assert [d.tolist() for d in shards.read(order)] == [documents[i].tolist() for i in order]


def test_splits_share_the_directory_and_are_replaced_whole(tmp_path):
    for split, count in [("train", 30), ("validation", 3), ("train", 5)]:
        writer = ShardWriter(str(tmp_path), split, BIG_VOCAB, shard_tokens=10, source="test")
        for i in range(count):
            writer.add(np.arange(i, i + 4, dtype=np.int32))
        writer.finish({})
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert {k: v["documents"] for k, v in index["splits"].items()} == {"train": 5, "validation": 3}
    listed = {
        name
        for split in index["splits"].values()
        for s in split["shards"]
        for name in (s["file"], s["offsets"])
    }
    assert {p.name for p in tmp_path.iterdir()} == listed | {INDEX_FILE}


def test_mismatches_are_refused(tmp_path):
    writer = ShardWriter(str(tmp_path), "train", BIG_VOCAB, shard_tokens=10, source="test")
    writer.add(np.arange(5, dtype=np.int32))
    writer.finish({})
    other = StubTokenizer(name_or_path="other", vocab_size=4096, bos_token_id=1, eos_token_id=2)
    with pytest.raises(
        DataConfigError, match="tokenized with 'big' \\(vocab_size=100000\\).*vocab_size=4096"
    ):
        TokenShards.open(str(tmp_path), "train", other)
    with pytest.raises(DataConfigError, match="has no split 'validation'; it has train"):
        TokenShards.open(str(tmp_path), "validation", BIG_VOCAB)
    with pytest.raises(DataConfigError, match="already holds splits prepared with another tokenizer"):
        ShardWriter(str(tmp_path), "validation", other, shard_tokens=10, source="test")
