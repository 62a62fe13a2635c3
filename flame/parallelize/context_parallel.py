"""Context parallelism on the trainer's side: which rank trains on which slice of a batch, and what CP runs with.

The exchanges inside the mixers are in flame.ops.context_parallel (all-gathered keys/values for attention, the
previous rank's tokens for short convolutions, a state relay for GatedDeltaNet/DeltaNet recurrences); the trainer
shards each batch with ``shard_batch`` and runs forward + backward inside ``sequence_sharded(cp group)``. FSDP then
shards parameters over data parallel x cp (torchtitan's "fsdp" mesh) and the loss is normalised over the "loss"
mesh (data parallel x cp), so gradients equal one process's on the whole sequences.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from flame.errors import ConfigError
from flame.models.layers.attention import Attention
from flame.ops.context_parallel import shard_sequence


def shard_batch(inputs: dict, labels: Tensor, group: dist.ProcessGroup) -> tuple[dict, Tensor]:
    """This rank's slice of every sequence: tokens, labels and their global positions (RoPE and the scaled
    softpick variants read positions, which must continue across the slices)."""
    tokens = inputs["input"]
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    sharded = {
        **inputs,
        "input": shard_sequence(tokens, group),
        "position_ids": shard_sequence(positions, group),
    }
    return sharded, shard_sequence(labels, group)


def check_context_parallel(job_config, model, degrees: dict[str, int]) -> None:
    """One line for every CP setting flame cannot run (model: built on the meta device)."""
    cp = degrees["cp"]
    if degrees["tp"] > 1 or degrees["pp"] > 1:
        raise ConfigError(
            "context parallelism does not combine with tensor or pipeline parallelism yet; "
            "use context_parallel_degree with data parallelism (FSDP/HSDP) only"
        )
    training = job_config.training
    if training.varlen:
        raise ConfigError(
            "context parallelism splits fixed-length rows; training.varlen (packed documents) is not supported "
            "with context_parallel_degree > 1"
        )
    if training.seq_len % cp:
        raise ConfigError(
            f"training.seq_len {training.seq_len} is not divisible by context_parallel_degree {cp}"
        )
    for name, module in model.named_modules():
        if isinstance(module, Attention) and module.window_size is not None and module.score_fn == "softmax":
            # A query slice against a longer key range has no windowed softmax kernel: the fallback would
            # materialize the scores.
            raise ConfigError(
                f"{name}: sliding-window softmax attention is not supported with context parallelism; "
                "set context_parallel_degree 1 (softpick / rectified windows are supported)"
            )
