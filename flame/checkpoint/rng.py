"""The random number generators of every rank, saved with each checkpoint so that a resumed run draws the numbers
the uninterrupted run would have drawn (torchtitan 0.2.2 saves no RNG state).

Every generator's state is stored as tensors (Python's and NumPy's Mersenne Twister words, torch's state bytes),
so the checkpoint holds no pickled object. DCP keeps one copy of an entry that every rank saves under the same
name, so the states of all ranks are gathered into tensors with one row per rank; on load each rank takes its
own row. A checkpoint written with another world size keeps the freshly seeded generators (with a warning, from
the checkpoint manager): the data order still resumes exactly, random draws do not.
"""

import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful


def _local_state() -> dict[str, torch.Tensor]:
    version, words, gauss = random.getstate()
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    state = {
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor([*keys.tolist(), position, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached_gauss], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def _set_local_state(state: dict[str, torch.Tensor]) -> None:
    python = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    numpy = state["numpy"].tolist()
    keys = np.array(numpy[:-2], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, numpy[-2], numpy[-1], state["numpy_gauss"].item()))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class RNGState(Stateful):
    def state_dict(self) -> dict[str, torch.Tensor]:
        local = _local_state()
        if _distributed():
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, local)
        else:
            states = [local]
        return {key: torch.stack([state[key] for state in states]) for key in local}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        rank = dist.get_rank() if _distributed() else 0
        # A copy of the row: torch.set_rng_state reads a tensor's storage from its start, ignoring the row's offset.
        _set_local_state({key: rows[rank].clone() for key, rows in state_dict.items()})
