"""python -m flame.data.prepare, and training from its output exactly like from the online source."""

import json
import pickle

import numpy as np
import pytest

from flame.data import build_dataloader
from flame.data.prepare import main
from flame.data.shards import INDEX_FILE, TokenShards
from flame.data.tokenize import DocumentEncoder
from tests.data.helpers import (
    TOKENIZER_DIR,
    assert_same_batches,
    job_config,
    numbered_texts,
    take,
    write_jsonl,
)


def prepare(*argv: str) -> None:
    main([*argv, "--tokenizer", str(TOKENIZER_DIR)])


def test_prepare_writes_the_documents_in_order_and_counts_skips(tmp_path, tokenizer, capsys):
    texts = numbered_texts(50)
    texts[3] = ""
    write_jsonl(tmp_path / "corpus" / "train.jsonl.gz", texts)
    output = tmp_path / "tokens"
    prepare("--dataset", str(tmp_path / "corpus"), "--output", str(output), "--shard_tokens", "300")
    assert "49 documents" in capsys.readouterr().out
    index = json.loads((output / INDEX_FILE).read_text())
    assert index["dtype"] == "uint16" and index["splits"]["train"]["counts"] == {"skipped_empty": 1}
    assert len(index["splits"]["train"]["shards"]) > 1
    shards = TokenShards.open(str(output), "train", tokenizer)
    expected = [d.tokens.tolist() for d in DocumentEncoder(tokenizer)(texts) if d.tokens is not None]
    assert [d.tolist() for d in shards.read(list(range(len(shards))))] == expected
    assert np.fromfile(output / "train-00000.bin", dtype=np.uint16)[:3].tolist() == expected[0][:3]


def test_prepare_reports_mistakes_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_code:
        prepare("--dataset", "json,parquet", "--output", str(tmp_path))
    assert exit_code.value.code == 2
    assert (
        capsys.readouterr().err
        == "error: prepare one dataset at a time; mix prepared directories at training time\n"
    )


@pytest.fixture
def prepared(tmp_path):
    """A corpus (train and validation) and its prepared tokens."""
    write_jsonl(tmp_path / "corpus" / "train.jsonl", numbered_texts(40))
    write_jsonl(tmp_path / "corpus" / "validation.jsonl", numbered_texts(8, start=500))
    for split in ("train", "validation"):
        prepare(
            "--dataset",
            str(tmp_path / "corpus"),
            "--dataset_split",
            split,
            "--output",
            str(tmp_path / "tokens"),
        )
    return tmp_path / "corpus", tmp_path / "tokens"


@pytest.mark.parametrize("varlen", [False, True])
def test_training_from_prepared_tokens_matches_online_tokenization(prepared, tokenizer, varlen):
    corpus, tokens = prepared
    flags = dict(seq_len=32, varlen=varlen, batch_size=1 if varlen else 3)
    online = take(build_dataloader(job_config(dataset=str(corpus), **flags), tokenizer), 30)
    offline = take(build_dataloader(job_config(dataset=str(tokens), **flags), tokenizer), 30)
    assert_same_batches(online, offline)
    validation = list(
        build_dataloader(job_config(dataset=str(tokens), **flags), tokenizer, split="validation")
    )
    assert_same_batches(
        list(build_dataloader(job_config(dataset=str(corpus), **flags), tokenizer, split="validation")),
        validation,
    )


def test_prepared_tokens_resume_with_ranks_and_workers(prepared, tokenizer):
    _, tokens = prepared
    config = job_config(
        "--training.dataloader.num_workers", "2", dataset=str(tokens), seq_len=32, batch_size=2
    )
    for rank in range(2):
        uninterrupted = take(build_dataloader(config, tokenizer, rank, 2), 30)
        stopped = build_dataloader(config, tokenizer, rank, 2)
        take(stopped, 11)
        resumed = build_dataloader(config, tokenizer, rank, 2)
        resumed.load_state_dict(pickle.loads(pickle.dumps(stopped.state_dict())))
        assert_same_batches(uninterrupted[11:], take(resumed, 19))
