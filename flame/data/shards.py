"""Prepared token shards: the on-disk format written by ``python -m flame.data.prepare`` and read for training.

A prepared directory holds, per split, binary shards of concatenated documents (each already
``[BOS] + tokens + [EOS]``) and the document offsets of each shard, described by a JSON index::

    DIR/flame_tokens.json                 the index (below)
    DIR/train-00000.bin                   tokens, native byte order, uint16 (vocab < 65536) or uint32
    DIR/train-00000.offsets.npy           uint64 [documents + 1]: document i is tokens[offsets[i]:offsets[i+1]]

    {"format": "flame-tokens", "version": 1, "dtype": "uint16",
     "tokenizer": {"name_or_path": ..., "vocab_size": ..., "bos_token_id": ..., "eos_token_id": ...},
     "splits": {"train": {"source": ..., "documents": ..., "tokens": ..., "counts": {...},
                          "shards": [{"file": "train-00000.bin", "offsets": "train-00000.offsets.npy",
                                      "documents": ..., "tokens": ...}, ...]}}}

Offsets live in ``.npy`` files rather than in the JSON so that corpora of millions of documents keep a small
index. Shards are memory-mapped when first read (in the dataloader worker), so the dataset object stays small
when it is sent to worker processes.
"""

import contextlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from flame.data.config import DataConfigError

INDEX_FILE = "flame_tokens.json"
FORMAT = "flame-tokens"
VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 1 << 16 else np.dtype(np.uint32)


def tokenizer_identity(tokenizer) -> dict:
    """What must match between the tokenizer that prepared the shards and the one that trains on them."""
    return {
        "name_or_path": str(tokenizer.name_or_path),
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def read_index(directory: str) -> dict:
    path = os.path.join(directory, INDEX_FILE)
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataConfigError(f"cannot read the token index '{path}': {e}") from e
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise DataConfigError(f"'{path}' is not a {FORMAT} version {VERSION} index")
    return index


@dataclass
class TokenShards:
    """The documents of one split of a prepared directory, addressable by a global document index."""

    directory: str
    dtype: np.dtype
    shards: list[dict]
    description: str
    first_document: np.ndarray = field(init=False)
    _arrays: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self):
        # first_document[s] is the global index of shard s's first document (plus a final total).
        self.first_document = np.cumsum([0] + [s["documents"] for s in self.shards])

    @classmethod
    def open(cls, directory: str, split: str, tokenizer) -> "TokenShards":
        index = read_index(directory)
        if split not in index["splits"]:
            raise DataConfigError(
                f"prepared directory '{directory}' has no split '{split}'; it has {', '.join(index['splits'])}"
            )
        expected, found = index["tokenizer"], tokenizer_identity(tokenizer)
        mismatched = [k for k in ("vocab_size", "bos_token_id", "eos_token_id") if expected[k] != found[k]]
        if mismatched:
            raise DataConfigError(
                f"prepared directory '{directory}' was tokenized with '{expected['name_or_path']}' "
                f"({', '.join(f'{k}={expected[k]}' for k in mismatched)}), but model.tokenizer_path gives "
                f"{', '.join(f'{k}={found[k]}' for k in mismatched)}"
            )
        shards = index["splits"][split]["shards"]
        for shard in shards:
            for key in ("file", "offsets"):
                if not os.path.isfile(os.path.join(directory, shard[key])):
                    raise DataConfigError(f"prepared directory '{directory}' lacks its file '{shard[key]}'")
        description = f"prepared tokens '{directory}' (split={split})"
        source = cls(directory, np.dtype(index["dtype"]), shards, description)
        if len(source) == 0:
            raise DataConfigError(f"{description} has no documents")
        return source

    def __len__(self) -> int:
        return int(self.first_document[-1])

    def read(self, indices: list[int]) -> list[np.ndarray]:
        """The documents at these global indices, as int32 arrays."""
        shard_of = np.searchsorted(self.first_document, indices, side="right") - 1
        documents = []
        for index, shard in zip(indices, shard_of.tolist()):
            tokens, offsets = self._shard(shard)
            local = index - int(self.first_document[shard])
            documents.append(tokens[offsets[local] : offsets[local + 1]].astype(np.int32))
        return documents

    def _shard(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        if shard not in self._arrays:
            entry = self.shards[shard]
            tokens = np.memmap(os.path.join(self.directory, entry["file"]), dtype=self.dtype, mode="r")
            offsets = np.load(os.path.join(self.directory, entry["offsets"]), mmap_mode="r")
            self._arrays[shard] = (tokens, offsets)
        return self._arrays[shard]

    def __getstate__(self) -> dict:
        # Memory maps are opened again where they are used; pickling them would copy the whole shard.
        return {**self.__dict__, "_arrays": {}}


class ShardWriter:
    """Appends documents to shards of about ``shard_tokens`` tokens (a document never straddles two shards) and
    records them in the directory's index, keeping the index entries of other splits."""

    def __init__(self, directory: str, split: str, tokenizer, shard_tokens: int, source: str):
        self.directory = directory
        self.split = split
        self.tokenizer = tokenizer_identity(tokenizer)
        self.dtype = token_dtype(self.tokenizer["vocab_size"])
        self.shard_tokens = shard_tokens
        self.source = source
        self.shards: list[dict] = []
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        os.makedirs(directory, exist_ok=True)
        self._index = self._existing_index()

    def add(self, document: np.ndarray) -> None:
        self._pending.append(document)
        self._pending_tokens += len(document)
        if self._pending_tokens >= self.shard_tokens:
            self._flush()

    def finish(self, counts: dict[str, int]) -> dict:
        """Write the last shard and the index; returns the split's index entry."""
        if self._pending:
            self._flush()
        entry = {
            "source": self.source,
            "documents": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "counts": counts,
            "shards": self.shards,
        }
        previous = self._index["splits"].get(self.split, {"shards": []})
        self._index["splits"][self.split] = entry
        path = os.path.join(self.directory, INDEX_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(self._index, f, indent=1)
        os.replace(path + ".tmp", path)
        written = {name for shard in self.shards for name in (shard["file"], shard["offsets"])}
        for shard in previous["shards"]:  # shards of an earlier, longer preparation of this split
            for name in (shard["file"], shard["offsets"]):
                if name not in written:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.directory, name))
        return entry

    def _flush(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}"
        lengths = [len(d) for d in self._pending]
        offsets = np.zeros(len(lengths) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        np.concatenate(self._pending).astype(self.dtype).tofile(os.path.join(self.directory, f"{name}.bin"))
        np.save(os.path.join(self.directory, f"{name}.offsets.npy"), offsets)
        self.shards.append(
            {
                "file": f"{name}.bin",
                "offsets": f"{name}.offsets.npy",
                "documents": len(lengths),
                "tokens": int(offsets[-1]),
            }
        )
        self._pending, self._pending_tokens = [], 0

    def _existing_index(self) -> dict:
        fresh = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, "tokenizer": self.tokenizer}
        if not os.path.isfile(os.path.join(self.directory, INDEX_FILE)):
            return {**fresh, "splits": {}}
        index = read_index(self.directory)
        if index["tokenizer"] != self.tokenizer:
            raise DataConfigError(
                f"'{self.directory}' already holds splits prepared with another tokenizer "
                f"({index['tokenizer']['name_or_path']}); use a new --output directory"
            )
        return index
