"""Packing documents into training rows of ``seq_len`` tokens, and collating rows into batches.

* Fixed windows (default): documents are concatenated into one token stream, cut into windows of
  ``seq_len + 1`` tokens that overlap by one token (input = window[:-1], labels = window[1:]), so every
  token after the first is a target exactly once. Attention and targets cross document boundaries, as in
  torchtitan's loader.
* Varlen (``training.varlen``, batch size 1): documents are concatenated into one row, each a separate
  sequence for attention: ``cu_seqlens`` (int32, from 0 to seq_len) marks where each piece starts and
  ``position_ids`` restart at 0 in each piece. A document is cut into pieces of at most ``context_len`` tokens,
  and at the end of a row (the rest starts the next row). The label of a document's last token is -100 (its
  next token belongs to another document); the last token of a piece that is not its document's last keeps
  the document's next token as its label.

Tokens that a document marks as context only (flame/data/tokenize.py: the prompts of chat data) are inputs
whose labels are -100.

The packers keep the tokens of the document being cut (the leftover) in their state, so a resumed run
continues in the middle of a document exactly where it stopped.
"""

import numpy as np
import torch

from flame.data.documents import count
from flame.data.tokenize import split_targets
from flame.loss import IGNORE_INDEX

SPLIT_DOCUMENTS = "split_long_documents"
SKIPPED_PAIRS = "skipped_pairs_too_long"

Sample = tuple[dict[str, torch.Tensor], torch.Tensor]


class FixedWindowPacker:
    def __init__(self, documents, seq_len: int):
        self._documents = documents
        self._seq_len = seq_len
        self._chunks: list[np.ndarray] = []  # tokens not yet emitted, in order
        self._buffered = 0

    def __iter__(self):
        return self

    def __next__(self) -> Sample:
        window = self._seq_len + 1
        while self._buffered < window:
            document = next(self._documents)
            self._chunks.append(document)
            self._buffered += len(document)
        # A long document stays one chunk that is sliced (views, no copy) window after window.
        tokens = self._chunks[0] if len(self._chunks) == 1 else np.concatenate(self._chunks)
        rest = tokens[self._seq_len :]  # the window's last token is the next window's first input
        self._chunks, self._buffered = [rest], len(rest)
        ids, is_target = split_targets(tokens[:window])
        labels = np.where(is_target[1:], ids[1:], IGNORE_INDEX)
        return {"input": torch.from_numpy(ids[:-1].astype(np.int64))}, torch.from_numpy(
            labels.astype(np.int64)
        )

    def state_dict(self) -> dict:
        leftover = np.concatenate(self._chunks) if self._chunks else np.empty(0, dtype=np.int32)
        return {"leftover": leftover}

    def load_state_dict(self, state: dict) -> None:
        self._chunks = [state["leftover"]]
        self._buffered = len(state["leftover"])


class VarlenPacker:
    def __init__(self, documents, seq_len: int, context_len: int, stats: dict[str, int]):
        self._documents = documents
        self._seq_len = seq_len
        self._context_len = context_len
        self._stats = stats
        self._leftover = np.empty(0, dtype=np.int32)  # the unpacked end of the current document

    def __iter__(self):
        return self

    def __next__(self) -> Sample:
        tokens, labels, lengths = [], [], []
        room = self._seq_len
        while room > 0:
            if len(self._leftover) == 0:
                self._leftover = next(self._documents)
                if len(self._leftover) > self._context_len:
                    count(self._stats, SPLIT_DOCUMENTS, f"longer than context_len={self._context_len}")
            piece = min(room, self._context_len, len(self._leftover))
            tokens.append(self._leftover[:piece])
            # Targets are the document's next tokens; the document's last token has none.
            next_tokens = self._leftover[1 : piece + 1]
            labels.append(np.where(next_tokens >= 0, next_tokens, IGNORE_INDEX))
            if piece == len(self._leftover):
                labels.append(np.array([IGNORE_INDEX], dtype=np.int32))
            lengths.append(piece)
            self._leftover = self._leftover[piece:]
            room -= piece
        cu_seqlens = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:])
        position_ids = np.arange(self._seq_len) - np.repeat(cu_seqlens[:-1], lengths)
        ids, _ = split_targets(np.concatenate(tokens))
        labels = np.concatenate(labels)
        inputs = {
            "input": torch.from_numpy(ids.astype(np.int64)),
            "cu_seqlens": torch.from_numpy(cu_seqlens),
            "position_ids": torch.from_numpy(position_ids.astype(np.int64)),
        }
        return inputs, torch.from_numpy(labels.astype(np.int64))

    def state_dict(self) -> dict:
        return {"leftover": np.array(self._leftover)}

    def load_state_dict(self, state: dict) -> None:
        self._leftover = state["leftover"]


class PairPacker:
    """Preference pairs (job.task dpo): each pair of documents (chosen, rejected) becomes two rows of seq_len
    tokens, padded at the end; padding and context tokens have no target. A reply cut off at seq_len keeps what
    fits; a pair in which a reply has no target left is skipped (counted)."""

    def __init__(self, documents, seq_len: int, stats: dict[str, int]):
        self._documents = documents
        self._seq_len = seq_len
        self._stats = stats

    def __iter__(self):
        return self

    def __next__(self) -> Sample:
        while True:
            rows = [self._row(document) for document in next(self._documents)]
            if all((labels != IGNORE_INDEX).any() for _, labels in rows):
                return {"input": torch.stack([r for r, _ in rows])}, torch.stack(
                    [labels for _, labels in rows]
                )
            count(self._stats, SKIPPED_PAIRS, f"a reply starts after seq_len={self._seq_len}")

    def _row(self, document: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ids, is_target = split_targets(document[: self._seq_len + 1])
        inputs = np.zeros(self._seq_len, dtype=np.int64)
        labels = np.full(self._seq_len, IGNORE_INDEX, dtype=np.int64)
        inputs[: len(ids) - 1] = ids[:-1]
        labels[: len(ids) - 1] = np.where(is_target[1:], ids[1:], IGNORE_INDEX)
        return torch.from_numpy(inputs), torch.from_numpy(labels)

    def state_dict(self) -> dict:
        return {}  # a pair is read whole: the documents' state says where the next starts

    def load_state_dict(self, state: dict) -> None:
        pass


def collate_pairs(samples: list[Sample]) -> Sample:
    """A batch of B pairs as 2B rows: the B chosen rows, then the B rejected rows in the same order."""
    inputs = torch.cat([torch.stack([s[0]["input"][i] for s in samples]) for i in (0, 1)])
    labels = torch.cat([torch.stack([s[1][i] for s in samples]) for i in (0, 1)])
    return {"input": inputs}, labels


def collate(samples: list[Sample]) -> Sample:
    """Stack samples into a batch; varlen rows (batch size 1) keep their 1-D cu_seqlens."""
    inputs = {"input": torch.stack([s[0]["input"] for s in samples])}
    if "cu_seqlens" in samples[0][0]:
        if len(samples) != 1:
            raise ValueError(f"varlen batches hold one row, got {len(samples)}")
        inputs["cu_seqlens"] = samples[0][0]["cu_seqlens"]
        inputs["position_ids"] = samples[0][0]["position_ids"].unsqueeze(0)
    return inputs, torch.stack([s[1] for s in samples])
