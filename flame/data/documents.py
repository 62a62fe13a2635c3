"""The documents one data shard reads from one source, in order, with a small state for exact resume.

A data shard is one (data-parallel rank, dataloader worker) pair: shard ``rank * num_workers + worker`` of
``dp_world_size * num_workers``. The shards of a source partition it: within an epoch every document is
read by exactly one shard, once.

* Map-style sources (an HF dataset in memory-mapped Arrow files, or prepared token shards): each epoch is a
  permutation of all rows seeded with (seed, source, epoch), the same in every shard, of which shard ``k``
  reads entries ``k, k + count, ...``; the next epoch draws a new permutation.
* Streamed sources: the stream is split into disjoint shards (whole files when the number of files is a
  multiple of the shard count, else every count-th row), read in blocks of ``shuffle_buffer`` rows. Each
  block is shuffled with a seed of (seed, source, shard, epoch, block), so every epoch has another order.

The state is a handful of integers (plus the stream's position at the start of the current block): the
StatefulDataLoader sends it from the worker with every batch. Rows already read but not yet consumed
(the current block, the current tokenized batch) are read and tokenized again on resume instead of being saved.
"""

import logging
from collections import deque
from collections.abc import Callable

import numpy as np

from flame.data.chat import BadRow
from flame.data.config import DataConfigError
from flame.data.sources import StreamedTextSource
from flame.data.tokenize import Encoded

logger = logging.getLogger(__name__)

TOKENIZE_BATCH = 128
"""Rows read and tokenized together: large enough for the tokenizer's batch speed, small enough to redo on resume"""


def count(stats: dict[str, int], key: str, where: str) -> None:
    """Add one to a data statistic, and log it the 1st, 10th, 100th ... time."""
    stats[key] = stats.get(key, 0) + 1
    if str(stats[key]).strip("0") == "1":
        logger.warning(f"data: {key} = {stats[key]} ({where})")


class EmptyShardError(RuntimeError):
    """A data shard holds no usable document (looping over it would never yield one)."""


class _Documents:
    """What both kinds share: rows are encoded in batches, consumed one by one, and counted."""

    def __init__(self, source, encode, source_index, shard, num_shards, seed, infinite, stats):
        self._source = source
        self._encode = encode
        self._source_index = source_index
        self._shard = shard
        self._num_shards = num_shards
        self._seed = seed
        self._infinite = infinite
        self._stats = stats
        self._epoch = 0
        self._position = (
            0  # rows consumed, counted from the start of the epoch (map-style) or block (streams)
        )
        self._documents_in_epoch = 0
        self._pending: deque[Encoded] = deque()  # the encoded rows from _position on

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        while True:
            if not self._pending:
                self._encode_more()
            encoded = self._pending.popleft()
            self._position += 1
            if encoded.note:
                count(self._stats, encoded.note, self._source.description)
            if encoded.tokens is not None:
                self._documents_in_epoch += 1
                return encoded.tokens

    def _encode_more(self) -> None:
        raise NotImplementedError


class IndexedDocuments(_Documents):
    """The documents of a map-style source for one data shard."""

    def __init__(
        self,
        source,
        encode: Callable[[list], list[Encoded]],
        source_index: int,
        shard: int,
        num_shards: int,
        seed: int,
        shuffle: bool,
        infinite: bool,
        stats: dict[str, int],
    ):
        super().__init__(source, encode, source_index, shard, num_shards, seed, infinite, stats)
        self._shuffle = shuffle
        self._empty_epochs = 0  # epochs in a row without a usable document
        self._order_epoch: int | None = None
        self._order = np.empty(0, dtype=np.int64)

    def _encode_more(self) -> None:
        order = self._epoch_order()
        if self._position >= len(order):
            if not self._infinite:
                raise StopIteration
            self._next_epoch()
            order = self._epoch_order()
        rows = order[self._position : self._position + TOKENIZE_BATCH].tolist()
        try:
            self._pending.extend(self._encode(self._source.read(rows)))
        except BadRow as e:
            raise DataConfigError(f"{self._source.description}, row {rows[e.position]}: {e.reason}") from None

    def _next_epoch(self) -> None:
        # Each epoch deals this shard other rows, so an epoch without a usable document is possible; so many
        # in a row that the odds are below 1e-6 if even one row of the dataset is usable mean none is.
        self._empty_epochs = 0 if self._documents_in_epoch else self._empty_epochs + 1
        if self._empty_epochs >= 16 * self._num_shards:
            raise EmptyShardError(
                f"{self._source.description}: no usable document in data shard {self._shard} "
                f"for {self._empty_epochs} epochs; are all its texts empty?"
            )
        self._epoch, self._position, self._documents_in_epoch = self._epoch + 1, 0, 0

    def _epoch_order(self) -> np.ndarray:
        """The rows this shard reads in the current epoch, in order."""
        if self._order_epoch != self._epoch:
            rows = len(self._source)
            if self._shuffle:
                rng = np.random.default_rng((self._seed, self._source_index, self._epoch))
                everything = rng.permutation(rows)
            else:
                everything = np.arange(rows)
            self._order = everything[self._shard :: self._num_shards]
            self._order_epoch = self._epoch
        return self._order

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "documents_in_epoch": self._documents_in_epoch,
            "empty_epochs": self._empty_epochs,
        }

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state["epoch"]
        self._position = state["position"]
        self._documents_in_epoch = state["documents_in_epoch"]
        self._empty_epochs = state["empty_epochs"]
        self._pending.clear()


class StreamedDocuments(_Documents):
    """The documents of a streamed source for one data shard."""

    def __init__(
        self,
        source: StreamedTextSource,
        encode: Callable[[list], list[Encoded]],
        source_index: int,
        shard: int,
        num_shards: int,
        seed: int,
        shuffle_buffer: int,
        infinite: bool,
        stats: dict[str, int],
    ):
        super().__init__(source, encode, source_index, shard, num_shards, seed, infinite, stats)
        self._stream = source.shard(shard, num_shards)
        self._shuffle = shuffle_buffer > 1
        self._block_size = shuffle_buffer if self._shuffle else TOKENIZE_BATCH
        self._block_index = 0
        # The stream's position where the current block starts (None: at the start of the epoch).
        self._block_start: dict | None = None
        self._block: list | None = None  # the current block's rows, shuffled; None until read
        self._next_block_start: dict | None = None
        self._batches = None  # the open stream of blocks of the current epoch

    def _encode_more(self) -> None:
        if self._block is None:
            self._read_block()
        while self._position >= len(self._block):
            self._block_index, self._position = self._block_index + 1, 0
            self._block_start = self._next_block_start
            self._read_block()
        try:
            self._pending.extend(self._encode(self._block[self._position : self._position + TOKENIZE_BATCH]))
        except BadRow as e:
            where = (
                f"row {self._position + e.position} of block {self._block_index} of data shard {self._shard}"
            )
            raise DataConfigError(f"{self._source.description}, {where}: {e.reason}") from None

    def _read_block(self) -> None:
        """Read the block that starts at ``_block_start``; at the end of the stream, the next epoch's first."""
        rows = self._next_rows()
        if rows is None:
            self._end_epoch()
            rows = self._next_rows() or []
        self._block = rows

    def _next_rows(self) -> list | None:
        if self._batches is None:
            self._stream.set_epoch(self._epoch)
            if self._block_start is not None:
                self._stream.load_state_dict(self._block_start)
            self._batches = self._stream.iter(batch_size=self._block_size)
        try:
            rows = self._source.rows(next(self._batches))
        except StopIteration:
            return None
        except Exception as e:  # a file that turned out corrupt: name the dataset, not only the parser
            raise RuntimeError(f"reading {self._source.description} failed: {e}") from e
        self._next_block_start = self._stream.state_dict()
        if self._shuffle:
            rng = np.random.default_rng(
                (self._seed, self._source_index, self._shard, self._epoch, self._block_index)
            )
            rows = [rows[i] for i in rng.permutation(len(rows))]
        return rows

    def _end_epoch(self) -> None:
        if not self._infinite:
            raise StopIteration
        if self._documents_in_epoch == 0:
            raise EmptyShardError(
                f"{self._source.description}: no usable document in data shard {self._shard}; "
                "use fewer data-parallel ranks or dataloader workers, or more data files"
            )
        self._epoch, self._block_index, self._position, self._documents_in_epoch = self._epoch + 1, 0, 0, 0
        self._block_start = self._next_block_start = None
        self._batches = None

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "block_index": self._block_index,
            "block_start": self._block_start,
            "position": self._position,
            "documents_in_epoch": self._documents_in_epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state["epoch"]
        self._block_index = state["block_index"]
        self._block_start = state["block_start"]
        self._position = state["position"]
        self._documents_in_epoch = state["documents_in_epoch"]
        self._block, self._batches = None, None
        self._pending.clear()
