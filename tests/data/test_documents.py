"""Per-shard document streams: shards partition each epoch, epochs are re-shuffled, state resumes exactly."""

import pickle

import pytest

from flame.data.config import source_specs
from flame.data.documents import EmptyShardError, IndexedDocuments, StreamedDocuments
from flame.data.sources import open_source
from flame.data.tokenize import SKIPPED_EMPTY, DocumentEncoder
from tests.data.helpers import numbered_texts, write_jsonl

DOCUMENTS = 30
SHARDS = 4


@pytest.fixture
def corpus(tmp_path):
    """The same 30 texts as one file and as four files."""
    texts = numbered_texts(DOCUMENTS)
    write_jsonl(tmp_path / "one" / "all.jsonl", texts)
    for part in range(4):
        write_jsonl(tmp_path / "four" / f"part{part}.jsonl", texts[part::4])
    return tmp_path, texts


def make_stream(tokenizer, directory, streaming, shard, stats=None, shuffle_buffer=5, seed=0):
    (spec,) = source_specs(str(directory), streaming=streaming)
    source = open_source(spec, tokenizer)
    common = dict(source_index=0, shard=shard, num_shards=SHARDS, seed=seed, infinite=True, stats=stats or {})
    encode = DocumentEncoder(tokenizer)
    if streaming:
        return StreamedDocuments(source, encode, shuffle_buffer=shuffle_buffer, **common)
    return IndexedDocuments(source, encode, shuffle=True, **common)


def shard_size(shard: int) -> int:
    # Row-level sharding (one file; map-style data) deals rows shard, shard + 4, ...; with four files each
    # shard reads one whole file, which holds the same number of rows.
    return len(range(shard, DOCUMENTS, SHARDS))


def read(stream, count: int) -> list[tuple[int, ...]]:
    return [tuple(next(stream).tolist()) for _ in range(count)]


@pytest.mark.parametrize("streaming, layout", [(False, "one"), (True, "one"), (True, "four")])
def test_shards_partition_every_epoch_and_epochs_are_reshuffled(tokenizer, corpus, streaming, layout):
    root, texts = corpus
    expected = sorted(tuple(d.tokens.tolist()) for d in DocumentEncoder(tokenizer)(texts))
    epochs = [[], []]
    for shard in range(SHARDS):
        stream = make_stream(tokenizer, root / layout, streaming, shard)
        size = shard_size(shard)
        epochs[0].append(read(stream, size))
        epochs[1].append(read(stream, size))
    for epoch in epochs:
        assert sorted(d for shard_documents in epoch for d in shard_documents) == expected
    assert epochs[0] != epochs[1]


@pytest.mark.parametrize("streaming", [False, True])
def test_the_seed_decides_the_order(tokenizer, corpus, streaming):
    root, _ = corpus
    first = read(make_stream(tokenizer, root / "one", streaming, 0, seed=1), 8)
    assert first == read(make_stream(tokenizer, root / "one", streaming, 0, seed=1), 8)
    assert first != read(make_stream(tokenizer, root / "one", streaming, 0, seed=2), 8)


@pytest.mark.parametrize("streaming, layout", [(False, "one"), (True, "one"), (True, "four")])
def test_state_resumes_exactly_across_blocks_and_epochs(tokenizer, corpus, streaming, layout):
    root, _ = corpus
    uninterrupted = read(make_stream(tokenizer, root / layout, streaming, 1), 40)
    for stop in (0, 3, 5, 8, 17, 23):
        stopped = make_stream(tokenizer, root / layout, streaming, 1)
        read(stopped, stop)
        state = pickle.loads(pickle.dumps(stopped.state_dict()))
        resumed = make_stream(tokenizer, root / layout, streaming, 1)
        resumed.load_state_dict(state)
        assert read(resumed, 40 - stop) == uninterrupted[stop:], f"stopped after {stop}"


@pytest.mark.parametrize("streaming", [False, True])
def test_empty_texts_are_skipped_and_counted(tmp_path, tokenizer, streaming):
    texts = numbered_texts(8)
    write_jsonl(tmp_path / "data.jsonl", [t if i % 2 else "" for i, t in enumerate(texts)])
    stats = {}
    (spec,) = source_specs(str(tmp_path / "data.jsonl"), streaming=streaming)
    source = open_source(spec, tokenizer)
    common = dict(source_index=0, shard=0, num_shards=1, seed=0, infinite=False, stats=stats)
    encode = DocumentEncoder(tokenizer)
    if streaming:
        stream = StreamedDocuments(source, encode, shuffle_buffer=0, **common)
    else:
        stream = IndexedDocuments(source, encode, shuffle=False, **common)
    expected = [tuple(d.tokens.tolist()) for d in encode(texts[1::2])]
    assert [tuple(d.tolist()) for d in stream] == expected
    assert stats == {SKIPPED_EMPTY: 4}


@pytest.mark.parametrize("streaming", [False, True])
def test_data_without_any_document_fails_clearly(tmp_path, tokenizer, streaming):
    write_jsonl(tmp_path / "data.jsonl", ["", " ", "\n", "", "\t"])
    stream = make_stream(tokenizer, tmp_path / "data.jsonl", streaming, shard=1)
    with pytest.raises(EmptyShardError, match="no usable document in data shard 1"):
        next(stream)


def test_a_stream_shard_without_any_document_fails_clearly(tmp_path, tokenizer):
    # Streams deal rows to shards the same way every epoch: shard 1 gets rows 1 and 5, both empty.
    write_jsonl(tmp_path / "data.jsonl", ["text", "", "text", "text", "text", " "])
    stream = make_stream(tokenizer, tmp_path / "data.jsonl", streaming=True, shard=1)
    with pytest.raises(EmptyShardError, match="no usable document in data shard 1"):
        next(stream)
