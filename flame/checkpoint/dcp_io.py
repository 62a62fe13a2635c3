"""Reading and writing model weights in DCP checkpoints in one process, without a process group.

DCP's ``.metadata`` maps every tensor to the chunks that each rank wrote and the files that hold them, so a
checkpoint written by any number of ranks (on any number of nodes, into one shared folder) is read here through
DCP itself: each requested tensor is assembled from its chunks, whatever the sharding was (flame #28 gathered
files instead). Model tensors sit at the top level of flame's checkpoints under flame's module names
(``embeddings.weight``, ``layers.0.attn.q_proj.weight`` ...), next to the ``optimizer``, ``lr_scheduler``,
``dataloader``, ``train_state`` and ``rng`` entries of a full checkpoint; a model-only checkpoint (step 0, the
seed checkpoint, ``last_save_model_only``) holds the model tensors alone.
"""

import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from flame.checkpoint.layout import CheckpointError

# Top-level entries of a full checkpoint besides the model's tensors (reference_model: DPO's frozen starting weights).
TRAINING_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "reference_model")


def read_metadata(path: str | os.PathLike) -> Metadata:
    try:
        return FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is not a complete DCP checkpoint (no .metadata)") from e


def is_training_state(key: str) -> bool:
    return key.split(".", 1)[0] in TRAINING_STATES


def model_shapes(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    """Shapes of the model tensors of a checkpoint."""
    return {
        key: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and not is_training_state(key)
    }


def is_model_only(metadata: Metadata) -> bool:
    return not any(key.startswith("train_state") for key in metadata.state_dict_metadata)


def check_model_matches(metadata: Metadata, expected: dict[str, tuple[int, ...]], where: str) -> None:
    """CheckpointError unless the checkpoint's model tensors are exactly the expected names and shapes."""
    saved = model_shapes(metadata)
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    wrong = sorted(k for k in set(saved) & set(expected) if saved[k] != tuple(expected[k]))
    if not (missing or extra or wrong):
        return
    if wrong:
        k = wrong[0]
        detail = f"{k} is {list(saved[k])} in the checkpoint but {list(expected[k])} in the model"
    elif missing:
        detail = f"the checkpoint has no {missing[0]}" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        )
    else:
        detail = f"the model has no {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
    raise CheckpointError(f"{where} was written by a different model config: {detail}")


def load_model_tensors(path: str | os.PathLike, state_dict: dict[str, torch.Tensor]) -> None:
    """Fill the given tensors (flame's names; any dtype) from a checkpoint, in place, in this process."""
    metadata = read_metadata(path)
    check_model_matches(metadata, {k: tuple(v.shape) for k, v in state_dict.items()}, str(path))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state_dict, storage_reader=FileSystemReader(str(path)), no_dist=True)


def save_model_tensors(path: str | os.PathLike, state_dict: dict[str, torch.Tensor]) -> None:
    """Write a model-only DCP checkpoint (what torchtitan loads as step 0) from one process."""
    Path(path).mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({k: v.contiguous() for k, v in state_dict.items()}, checkpoint_id=str(path), no_dist=True)
