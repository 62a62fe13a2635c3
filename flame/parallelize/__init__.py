"""Apply parallelisms to a flame model built on the meta device: activation checkpointing, per-block
torch.compile, then FSDP2/HSDP (or DDP) per block + root. One plan serves every family: all of them are a
``DecoderLM`` whose ``layers`` children are the blocks."""

from flame.parallelize.parallelize import parallelize_model

__all__ = ["parallelize_model"]
