"""Apply parallelisms to a flame model built on the meta device: float8, tensor parallelism, activation
checkpointing, per-block torch.compile, then FSDP2/HSDP per block + root, or DDP. One plan serves every family:
the family's ModelSpec says where its blocks are (flame's ``DecoderLM`` families: the children of ``layers``) and
which of tensor, pipeline and context parallelism it supports; tensor_parallel.py holds the per-mixer plans of
flame's own families. checks.py validates the options (train.sh's pre-flight runs it too).

Names are imported on first use, so that the pre-flight's ``flame.parallelize.checks`` does not import torchtitan.
"""

__all__ = [
    "check_parallelism",
    "parallelize_model",
    "pipeline_model",
    "tie_embeddings",
]


def __getattr__(name: str):
    if name == "check_parallelism":
        from flame.parallelize.checks import check_parallelism

        return check_parallelism
    if name in ("parallelize_model", "tie_embeddings"):
        from flame.parallelize import parallelize

        return getattr(parallelize, name)
    if name == "pipeline_model":
        from flame.parallelize import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'flame.parallelize' has no attribute {name!r}")
