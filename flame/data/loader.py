"""flame's dataloader: sources -> per-shard document streams -> mixture -> packed rows -> batches.

``build_dataloader`` opens and checks every dataset in the calling process, so that configuration mistakes
fail at once (:class:`DataConfigError`). Reading, tokenizing and packing happen in the dataloader workers
(``training.dataloader.num_workers``), or on the training thread when there are none.

Unset, the number of workers and pinned memory are chosen for the device (:func:`loader_options`): on a GPU a few
workers per rank and pinned batches, so that neither tokenizing nor the copy to the GPU holds up a step; on the CPU
none (the workers would take the cores the step runs on).

The loader is torchtitan's ``ParallelAwareDataloader`` (a torchdata ``StatefulDataLoader``): its
``state_dict()`` holds, under ``dp_rank_<r>``, the state of every worker's pipeline as of the last batch the
trainer received (prefetched batches do not count), so a run resumed from a checkpoint gets exactly the
batches the uninterrupted run would have got. Resuming needs the same data flags, data-parallel degree and
number of workers. torchtitan stores that state pickled; flame stores it as JSON text (NumPy arrays tagged with
their dtype), so loading a checkpoint's dataloader state runs no code from it.
"""

import json
import logging
import os
from dataclasses import asdict

import numpy as np
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.components.dataloader import ParallelAwareDataloader

from flame.data.chat import BadRow, ChatEncoder, PreferenceEncoder, load_chat_template
from flame.data.config import TRAIN, DataConfigError, DataSpec, data_spec
from flame.data.documents import IndexedDocuments, StreamedDocuments
from flame.data.mixing import DocumentMixer
from flame.data.packing import FixedWindowPacker, PairPacker, VarlenPacker, collate, collate_pairs
from flame.data.shards import TokenShards
from flame.data.sources import Source, StreamedTextSource, open_source
from flame.data.tokenize import DocumentEncoder, Encoded

logger = logging.getLogger(__name__)


class PackedTextDataset(IterableDataset, Stateful):
    """The rows of one data-parallel rank; each dataloader worker builds its own pipeline for its data shard."""

    def __init__(self, spec: DataSpec, sources: list[Source], tokenizer, dp_rank: int, dp_world_size: int):
        self.spec = spec
        self.sources = sources
        self.encoder = build_encoder(spec, tokenizer)
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._pipeline: _Pipeline | None = None
        self._resume_state: dict | None = None

    def __iter__(self):
        # Every iterator starts from the loaded state if there is one, else from the beginning.
        pipeline = _Pipeline(self, *self._shard())
        if self._resume_state is not None:
            pipeline.load_state_dict(self._resume_state)
            self._resume_state = None
        self._pipeline = pipeline
        # A plain generator: an iterator with state_dict() would have its state saved a second time by torchdata.
        return (row for row in pipeline.packer)

    def _shard(self) -> tuple[int, int]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        return self.dp_rank * num_workers + worker_id, self.dp_world_size * num_workers

    def state_dict(self) -> dict:
        if self._pipeline is not None:
            return self._pipeline.state_dict()
        return self._resume_state or {}

    def load_state_dict(self, state: dict) -> None:
        self._resume_state = state or None
        self._pipeline = None


class _Pipeline:
    """One data shard's iterator of rows, and its state."""

    def __init__(self, dataset: PackedTextDataset, shard: int, num_shards: int):
        spec = dataset.spec
        self.shard, self.num_shards = shard, num_shards
        self.stats: dict[str, int] = {}
        streams = [
            self._documents(source, index, dataset.encoder, spec)
            for index, source in enumerate(dataset.sources)
        ]
        mixer = DocumentMixer(streams, spec.probs, spec.seed, shard)
        if spec.task == "dpo":
            self.packer = PairPacker(mixer, spec.seq_len, self.stats)
        elif spec.varlen:
            self.packer = VarlenPacker(mixer, spec.seq_len, spec.context_len, self.stats)
        else:
            self.packer = FixedWindowPacker(mixer, spec.seq_len)
        self.mixer = mixer

    def _documents(self, source: Source, index: int, encoder: DocumentEncoder, spec: DataSpec):
        common = dict(source_index=index, shard=self.shard, num_shards=self.num_shards, seed=spec.seed)
        if isinstance(source, StreamedTextSource):
            return StreamedDocuments(
                source,
                encoder,
                **common,
                shuffle_buffer=spec.shuffle_buffer if spec.shuffle else 0,
                infinite=spec.infinite,
                stats=self.stats,
            )
        encode = _already_tokenized if isinstance(source, TokenShards) else encoder
        return IndexedDocuments(
            source, encode, **common, shuffle=spec.shuffle, infinite=spec.infinite, stats=self.stats
        )

    def state_dict(self) -> dict:
        return {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "stats": dict(self.stats),
            "documents": self.mixer.state_dict(),
            "packer": self.packer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["shard"], state["num_shards"]) != (self.shard, self.num_shards):
            raise DataConfigError(
                f"the checkpoint's dataloader state is for data shard {state['shard']} of {state['num_shards']}, "
                f"this worker reads shard {self.shard} of {self.num_shards}: resume with the same data-parallel "
                "degree and training.dataloader.num_workers"
            )
        self.stats.clear()
        self.stats.update(state["stats"])
        self.mixer.load_state_dict(state["documents"])
        self.packer.load_state_dict(state["packer"])


def build_encoder(spec: DataSpec, tokenizer):
    """Rows -> documents for the job's task: texts, conversations or preference pairs."""
    if spec.task == "pretrain":
        return DocumentEncoder(tokenizer)
    template = load_chat_template(tokenizer, spec.chat_template)
    return (ChatEncoder if spec.task == "sft" else PreferenceEncoder)(tokenizer, template)


def check_first_row(source: Source, encoder) -> None:
    """Encode a dataset's first row in this process, so that data the task cannot read fails at once."""
    if isinstance(source, TokenShards):
        return
    first = (
        source.read([0])
        if not isinstance(source, StreamedTextSource)
        else source.rows(next(iter(source.dataset.iter(batch_size=1))))
    )
    try:
        encoder(first)
    except BadRow as e:
        raise DataConfigError(f"{source.description}, row 0: {e.reason}") from None


def _already_tokenized(documents: list) -> list[Encoded]:
    return [Encoded(document, None) for document in documents]


_ARRAY = "__ndarray__"


def _encode(value):
    if isinstance(value, np.ndarray):
        return {_ARRAY: value.dtype.str, "data": value.tolist()}
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} in the dataloader state cannot be stored as plain data")


def _decode(obj: dict):
    return np.array(obj["data"], dtype=np.dtype(obj[_ARRAY])) if _ARRAY in obj else obj


def encode_state(state: dict) -> str:
    return json.dumps(state, default=_encode)


def decode_state(text: str) -> dict:
    return json.loads(text, object_hook=_decode)


class FlameDataLoader(ParallelAwareDataloader):
    """torchtitan's data-parallel-aware StatefulDataLoader over a :class:`PackedTextDataset`. ``workers_chosen``:
    the number of workers was not given but chosen for the machine, so a resumed run takes the checkpoint's."""

    def __init__(self, dataset, dp_rank: int, dp_world_size: int, workers_chosen: bool = False, **kwargs):
        super().__init__(dataset, dp_rank, dp_world_size, **kwargs)
        self.workers_chosen = workers_chosen

    def loader_state(self) -> dict:
        """The StatefulDataLoader's own state as of the last batch received: a new object every call, which the
        loader does not change afterwards (a device prefetcher keeps one per batch it holds)."""
        return super(ParallelAwareDataloader, self).state_dict()

    def checkpoint_state(self, loader_state: dict) -> dict:
        """What a checkpoint stores of ``loader_state``: JSON text under this rank's key."""
        return {self._rank_id: encode_state(loader_state), "world_size": self.dp_world_size}

    def state_dict(self) -> dict:
        return self.checkpoint_state(self.loader_state())

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self._rank_id not in state_dict:
            logger.warning(
                f"The checkpoint holds no dataloader state for {self._rank_id}: reading from the start"
            )
            return
        if state_dict["world_size"] != self.dp_world_size:
            raise DataConfigError(
                f"the checkpoint's dataloader state is for {state_dict['world_size']} data-parallel ranks, this run "
                f"has {self.dp_world_size}: resume with the same data-parallel degree"
            )
        state = decode_state(state_dict[self._rank_id])
        saved_workers = _workers_in(state)
        if saved_workers != self.num_workers:
            if not self.workers_chosen:
                raise DataConfigError(
                    f"the checkpoint's dataloader state was written with training.num_workers {saved_workers}, this "
                    f"run has {self.num_workers}: resume with --training.num_workers {saved_workers}"
                )
            # Exact resume needs the same data shards: the run goes on with the workers it was written with.
            logger.info(
                f"Resuming with the checkpoint's {saved_workers} dataloader workers per rank (training.num_workers "
                f"is unset; {self.num_workers} would be chosen on this machine)"
            )
            self.num_workers = saved_workers
            if saved_workers > 0:
                self.prefetch_factor = self.prefetch_factor or 2  # torch's default with workers
                _before_forking_workers()
        super(ParallelAwareDataloader, self).load_state_dict(state)

    def data_stats(self) -> dict[str, int]:
        """Counts of skipped or repaired documents (and documents split in varlen mode) summed over this rank's
        workers, as of the last batch received."""
        totals: dict[str, int] = {}
        for pipeline_state in _pipeline_states(super(ParallelAwareDataloader, self).state_dict()):
            for key, value in pipeline_state["stats"].items():
                totals[key] = totals.get(key, 0) + value
        return totals


def _before_forking_workers() -> None:
    # The tokenizer's own threads cannot be used after the workers fork; say so once instead of per worker.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _workers_in(state: dict) -> int:
    """Worker processes of the loader that saved a StatefulDataLoader state (0: the pipeline ran in the training
    process; the multi-process loader's state holds one snapshot per worker)."""
    return len(state["_snapshot"]["_worker_snapshots"]) if "_snapshot" in state else 0


def _pipeline_states(state):
    """The pipeline states inside a StatefulDataLoader state, wherever torchdata nests them."""
    if isinstance(state, dict):
        if "packer" in state and "stats" in state:
            yield state
        else:
            for value in state.values():
                yield from _pipeline_states(value)


MAX_AUTO_WORKERS = 4  # one worker packs ~6x what a GPU trains on (docs/performance.md); the rest is headroom


def cpus_per_rank() -> int:
    """The CPUs this process may run on, shared by the ranks torchrun started on this node."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def loader_options(options, device_type: str) -> dict:
    """StatefulDataLoader arguments from ``training.dataloader``. Unset (None) ``num_workers`` and ``pin_memory``
    are chosen for the device: on a GPU, min(4, CPUs per rank - 1) workers (at least one; a core stays with the
    training process) and pinned batches, whose copies to the GPU need not wait for the step before them; on the
    CPU, no workers and no pinning."""
    chosen = asdict(options)
    on_gpu = device_type == "cuda"
    if chosen["num_workers"] is None:
        chosen["num_workers"] = min(MAX_AUTO_WORKERS, max(1, cpus_per_rank() - 1)) if on_gpu else 0
    if chosen["pin_memory"] is None:
        chosen["pin_memory"] = on_gpu
    return chosen


def build_dataloader(
    job_config,
    tokenizer,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    split: str = TRAIN,
    device_type: str = "cpu",
) -> FlameDataLoader:
    """The dataloader of one data-parallel rank.

    Yields ``({"input": LongTensor[B, L]}, labels LongTensor[B, L])`` with -100 for no target; in varlen mode
    the dict also holds ``cu_seqlens`` (int32 [documents + 1]) and ``position_ids`` (LongTensor[1, L]).

    ``split="train"`` reads ``training.dataset_split``, shuffled and looped forever; another split name (e.g.
    ``"validation"``) reads that split of every dataset once, in order, and then stops. ``device_type`` is where
    the batches go (:func:`loader_options`).
    """
    spec = data_spec(job_config, split)
    sources = [open_source(source_spec, tokenizer) for source_spec in spec.sources]
    options = loader_options(job_config.training.dataloader, device_type)
    num_workers = options["num_workers"]
    num_shards = dp_world_size * max(num_workers, 1)
    for source in sources:
        if not isinstance(source, StreamedTextSource) and len(source) < num_shards:
            raise DataConfigError(
                f"{source.description} has {len(source)} documents, fewer than its {num_shards} data shards "
                f"({dp_world_size} data-parallel ranks x {max(num_workers, 1)} dataloader workers)"
            )
    if num_workers > 0:
        _before_forking_workers()
    dataset = PackedTextDataset(spec, sources, tokenizer, dp_rank, dp_world_size)
    if spec.task != "pretrain":
        for source in sources:
            check_first_row(source, dataset.encoder)
    pinned = ", pinned" if options["pin_memory"] else ""
    logger.info(
        f"data: {' + '.join(s.description for s in sources)}; rank {dp_rank}/{dp_world_size}, "
        f"{num_workers} workers{pinned}, batch {spec.batch_size} x {spec.seq_len}{' varlen' if spec.varlen else ''}"
    )
    return FlameDataLoader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=spec.batch_size,
        collate_fn=collate_pairs if spec.task == "dpo" else collate,
        workers_chosen=job_config.training.dataloader.num_workers is None,
        **options,
    )
