"""Context parallelism on the trainer's side: which rank trains on which slice of a batch, and what CP runs with.

The exchanges inside the mixers are in flame.ops.context_parallel (all-gathered keys/values for attention, the
previous rank's tokens for short convolutions, a state relay for GatedDeltaNet/DeltaNet recurrences); the trainer
shards each batch with ``shard_batch`` and runs forward + backward (or the pipeline schedule's step) inside
``sequence_sharded(cp group)``. FSDP then shards parameters over data parallel x cp (torchtitan's "fsdp" mesh) and
the loss is normalised over the "loss" mesh (data parallel x cp), so gradients equal one process's on the whole
sequences.

Packed documents (training.varlen: one row, ``cu_seqlens``): ``shard_batch`` gives each rank its slice's own
cu_seqlens and keeps the whole row's under ``ROW_CU_SEQLENS``, which the trainer hands to ``sequence_sharded`` for
the exchanges (short-convolution windows, the state relay and attention keys across borders).

With tensor parallelism the mixers get plain local tensors of their own heads and channels (colwise projections
hand over local outputs), so the exchanges run on those shards over the cp group: torchtitan's "cp" mesh joins the
ranks that hold the same heads of the neighbouring slices. Sequence parallelism then splits each slice again over
the tensor-parallel ranks between the mixers. With pipeline parallelism every micro-batch is a set of already
sliced rows, and the ranks of a cp group hold the same stages, so they run the same schedule and meet in the same
exchanges; the position ids go to every stage.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from flame.errors import ConfigError
from flame.models.layers.attention import Attention
from flame.ops.context_parallel import clip_cu_seqlens, shard_sequence

# The key of a sharded packed batch that holds the whole row's cu_seqlens (for sequence_sharded).
ROW_CU_SEQLENS = "row_cu_seqlens"


def shard_batch(inputs: dict, labels: Tensor, group: dist.ProcessGroup) -> tuple[dict, Tensor]:
    """This rank's slice of every sequence: tokens, labels and their global positions (RoPE and the scaled
    softpick variants read positions, which must continue across the slices). A packed row also gets the
    boundaries of the documents in its slice as ``cu_seqlens`` and keeps the row's under ``ROW_CU_SEQLENS``."""
    tokens = inputs["input"]
    cu_seqlens = inputs.get("cu_seqlens")
    positions = inputs.get("position_ids")
    if positions is None:  # packed rows come with their positions in their documents
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    sharded = {
        **inputs,
        "input": shard_sequence(tokens, group),
        "position_ids": shard_sequence(positions, group),
    }
    if cu_seqlens is not None:
        length = sharded["input"].shape[1]
        start = dist.get_rank(group) * length
        local = clip_cu_seqlens(cu_seqlens.tolist(), start, start + length)
        sharded["cu_seqlens"] = torch.tensor(local, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
        sharded[ROW_CU_SEQLENS] = cu_seqlens
    return sharded, shard_sequence(labels, group)


# Schedules that split each backward into an input-gradient and a weight-gradient pass: the second pass runs the
# backward of the cp exchanges again (the state relay's graph is gone by then, and the collectives would be
# repeated).
SPLIT_BACKWARD_SCHEDULES = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")


def check_context_parallel(job_config, model, degrees: dict[str, int]) -> None:
    """One line for every CP setting flame cannot run (model: built on the meta device)."""
    cp, tp, pp = degrees["cp"], degrees["tp"], degrees["pp"]
    if pp > 1:
        parallelism = job_config.parallelism
        if parallelism.pipeline_parallel_schedule.lower() in SPLIT_BACKWARD_SCHEDULES:
            raise ConfigError(
                f"context parallelism does not combine with the pipeline schedule "
                f"{parallelism.pipeline_parallel_schedule}, which splits the backward in two passes; use 1F1B, "
                "GPipe, Interleaved1F1B or LoopedBFS"
            )
        if parallelism.pipeline_parallel_schedule_csv:
            raise ConfigError(
                "context parallelism does not combine with pipeline_parallel_schedule_csv (a schedule file may "
                "split the backward in two passes); use pipeline_parallel_schedule 1F1B, GPipe, Interleaved1F1B "
                "or LoopedBFS"
            )
    training = job_config.training
    if training.seq_len % cp:
        raise ConfigError(
            f"training.seq_len {training.seq_len} is not divisible by context_parallel_degree {cp}"
        )
    if tp > 1 and pp == 1 and training.seq_len % (cp * tp):
        raise ConfigError(
            f"training.seq_len {training.seq_len} is not divisible by context_parallel_degree {cp} x "
            f"tensor_parallel_degree {tp} (sequence parallelism splits each cp slice over the tensor-parallel "
            "ranks)"
        )
    for name, module in model.named_modules():
        if isinstance(module, Attention) and module.window_size is not None and module.score_fn == "softmax":
            # A query slice against a longer key range has no windowed softmax kernel: the fallback would
            # materialize the scores.
            raise ConfigError(
                f"{name}: sliding-window softmax attention is not supported with context parallelism; "
                "set context_parallel_degree 1 (softpick / rectified windows are supported)"
            )
