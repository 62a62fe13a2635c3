"""Mixtures: documents drawn by probability, reproducibly, resumable; through the loader too."""

import pickle

import numpy as np
import pytest

from flame.data import DataConfigError, build_dataloader
from flame.data.mixing import DocumentMixer
from tests.data.helpers import BOS, documents_in, job_config, numbered_texts, take, write_jsonl


class NumberedStream:
    """An endless stateful stream of one-token documents [label, n] (n counts up)."""

    def __init__(self, label: int, limit: int | None = None):
        self.label, self.limit, self.position = label, limit, 0

    def __next__(self):
        if self.limit is not None and self.position >= self.limit:
            raise StopIteration
        self.position += 1
        return np.array([self.label, self.position])

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def draw(mixer, count):
    return [tuple(next(mixer).tolist()) for _ in range(count)]


def test_documents_follow_the_probabilities_reproducibly():
    probs = (0.2, 0.0, 0.8)
    drawn = draw(
        DocumentMixer([NumberedStream(0), NumberedStream(1), NumberedStream(2)], probs, seed=3, shard=0), 5000
    )
    shares = np.bincount([label for label, _ in drawn], minlength=3) / len(drawn)
    assert np.allclose(shares, probs, atol=0.02)
    assert drawn == draw(
        DocumentMixer([NumberedStream(0), NumberedStream(1), NumberedStream(2)], probs, seed=3, shard=0), 5000
    )
    assert drawn != draw(
        DocumentMixer([NumberedStream(0), NumberedStream(1), NumberedStream(2)], probs, seed=4, shard=0), 5000
    )
    assert drawn != draw(
        DocumentMixer([NumberedStream(0), NumberedStream(1), NumberedStream(2)], probs, seed=3, shard=1), 5000
    )


def test_state_resumes_the_draws():
    def mixer():
        return DocumentMixer([NumberedStream(0), NumberedStream(1)], (0.5, 0.5), seed=0, shard=0)

    uninterrupted = draw(mixer(), 100)
    stopped = mixer()
    draw(stopped, 37)
    resumed = mixer()
    resumed.load_state_dict(pickle.loads(pickle.dumps(stopped.state_dict())))
    assert draw(resumed, 63) == uninterrupted[37:]


def test_finite_streams_run_out_one_by_one():
    mixer = DocumentMixer(
        [NumberedStream(0, limit=3), NumberedStream(1, limit=50)], (0.9, 0.1), seed=0, shard=0
    )
    drawn = [tuple(document.tolist()) for document in mixer]
    assert sorted(drawn) == [(0, i) for i in range(1, 4)] + [(1, i) for i in range(1, 51)]


def test_loader_mixes_datasets_with_their_own_files_and_columns(tmp_path, tokenizer):
    first = write_jsonl(tmp_path / "a.jsonl", ["alpha " * 3] * 40)
    write_jsonl(tmp_path / "b.jsonl.gz", numbered_texts(40), column="content")
    config = job_config(
        dataset=f"json,{tmp_path}",
        data_files=f"{first},b.jsonl.gz",
        text_column="text,content",
        data_probs="0.75,0.25",
        seq_len=256,
        batch_size=2,
    )
    alpha = tuple([BOS] + tokenizer("alpha " * 3, add_special_tokens=False)["input_ids"] + [2])
    stream = [
        t
        for inputs, _ in take(build_dataloader(config, tokenizer), 20)
        for row in inputs["input"]
        for t in row.tolist()
    ]
    documents = documents_in(stream)
    share = sum(d == alpha for d in documents) / len(documents)
    assert len(documents) > 200 and 0.65 < share < 0.85


def test_loader_rejects_probabilities_that_do_not_fit(tmp_path, tokenizer):
    with pytest.raises(DataConfigError, match="data_probs has 1 values for 2 datasets"):
        build_dataloader(job_config(dataset="a,b", data_probs="1.0"), tokenizer)
