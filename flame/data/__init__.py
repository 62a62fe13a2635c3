"""flame's data pipeline: HF datasets or prepared token shards, tokenized online, mixed, shuffled, sharded
across data-parallel ranks and dataloader workers, packed into rows, with exact resume.

Public API (what the trainer calls)::

    tokenizer = build_tokenizer(job_config)
    dataloader = build_dataloader(job_config, tokenizer, dp_rank=r, dp_world_size=w)
    for input_dict, labels in dataloader: ...

Module map: config (flags), sources (opening datasets), tokenize (texts -> documents), documents (per-shard
order and shuffling), mixing, packing, loader (the dataloader), shards + prepare (offline tokenization).
"""

from flame.data.config import DataConfigError

__all__ = ["DataConfigError", "FlameDataLoader", "build_dataloader", "build_tokenizer"]


def __getattr__(name: str):
    # The loader and tokenizer import `datasets` and `transformers` (seconds): loaded on first use, so that
    # train.sh's pre-flight can check the data options (flame.data.config) within its time budget.
    if name in ("FlameDataLoader", "build_dataloader"):
        from flame.data import loader

        return getattr(loader, name)
    if name == "build_tokenizer":
        from flame.data.tokenize import build_tokenizer

        return build_tokenizer
    raise AttributeError(f"module 'flame.data' has no attribute '{name}'")
