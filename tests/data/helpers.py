"""Small corpora, job configs and batch comparisons shared by the data tests."""

import gzip
import json
from pathlib import Path

import torch

from flame.config import parse_args

ASSETS = Path(__file__).resolve().parents[2] / "flame" / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"
CORPUS_DIR = ASSETS / "corpus"
BOS, EOS = 1, 2  # the shipped tokenizer's


def job_config(*flags: str, **training):
    """A merged JobConfig; keyword arguments are training.* flags (True/False for switches)."""
    argv = list(flags)
    for key, value in training.items():
        if value is True:
            argv.append(f"--training.{key}")
        elif value is False:
            argv.append(f"--training.no-{key}")
        else:
            argv += [f"--training.{key}", str(value)]
    return parse_args(argv)


def numbered_texts(count: int, words: int = 12, start: int = 0) -> list[str]:
    """Distinct documents of a few words each; document i mentions its number."""
    return [
        f"document {i} " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words + i % 5))
        for i in range(start, start + count)
    ]


def write_jsonl(path: Path, texts: list, column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts))
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(lines.encode()))
    else:
        path.write_text(lines)
    return path


def take(loader, count: int) -> list:
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == count:
            return batches
    raise AssertionError(f"the loader stopped after {len(batches)} of {count} batches")


def assert_same_batches(expected: list, actual: list) -> None:
    assert len(expected) == len(actual)
    for step, ((inputs_a, labels_a), (inputs_b, labels_b)) in enumerate(zip(expected, actual)):
        assert inputs_a.keys() == inputs_b.keys(), step
        for key in inputs_a:
            assert torch.equal(inputs_a[key], inputs_b[key]), f"batch {step}: {key} differs"
        assert torch.equal(labels_a, labels_b), f"batch {step}: labels differ"


def documents_in(tokens: list[int]) -> list[tuple[int, ...]]:
    """Whole BOS ... EOS documents in a token stream (a partial one at either end is dropped)."""
    documents, current = [], None
    for token in tokens:
        if token == BOS:
            current = [token]
        elif current is not None:
            current.append(token)
            if token == EOS:
                documents.append(tuple(current))
                current = None
    return documents
