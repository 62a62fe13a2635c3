"""The token sequences the attention and activation statistics are measured on.

By default the text of flame's embedded corpus (flame/assets/corpus: CPython's standard-library documentation),
validation split first, then train, read only as far as needed; or any UTF-8 text file. Documents are tokenized
without special tokens and joined into one stream with EOS + BOS between documents (as flame's data pipeline
frames them). Each sequence is BOS followed by the next seq_len - 1 tokens of the stream, so that every sequence
starts with BOS, as flame's training documents and generation prompts do (without a BOS token in the tokenizer:
seq_len tokens of the stream).
"""

import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from flame.errors import FlameError

CORPUS = Path(__file__).resolve().parents[1] / "assets" / "corpus"
CORPUS_FILES = ("validation.jsonl.gz", "train.jsonl.gz")


def corpus_documents(folder: Path = CORPUS) -> Iterator[str]:
    for name in CORPUS_FILES:
        with gzip.open(folder / name, "rt", encoding="utf-8") as lines:
            for line in lines:
                yield json.loads(line)["text"]


def text_file_documents(path: Path) -> Iterator[str]:
    if not path.is_file():
        raise FlameError(f"the text file {path} does not exist")
    yield path.read_text(encoding="utf-8")


def token_sequences(documents: Iterable[str], tokenizer, seq_len: int, num_sequences: int) -> torch.Tensor:
    """[num_sequences, seq_len] int64 (see the module docstring); FlameError if the text is too short."""
    prefix = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    separator = [tok for tok in (tokenizer.eos_token_id, tokenizer.bos_token_id) if tok is not None]
    body = seq_len - len(prefix)
    needed = num_sequences * body
    stream: list[int] = []
    for document in documents:
        if stream:
            stream += separator
        stream += tokenizer.encode(document, add_special_tokens=False)
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise FlameError(
            f"the text has {len(stream)} tokens, fewer than {num_sequences} sequences of {seq_len} need; "
            "lower --seq_len or --num_sequences, or pass a longer --text_file"
        )
    return torch.tensor([prefix + stream[i * body : (i + 1) * body] for i in range(num_sequences)])
