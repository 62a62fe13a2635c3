"""The random number generators of every rank, saved with each checkpoint so that a resumed run draws the numbers
the uninterrupted run would have drawn (torchtitan 0.2.2 saves no RNG state).

DCP keeps one copy of an entry that every rank saves under the same name, so the states of all ranks are gathered
into one list; on load each rank takes its own. A checkpoint written with another world size keeps the freshly
seeded generators (with a warning): the data order still resumes exactly, random draws do not.
"""

import logging
import pickle
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger(__name__)


def _local_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_local_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class RNGState(Stateful):
    def state_dict(self) -> dict:
        local = _local_state()
        if _distributed():
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, local)
        else:
            states = [local]
        return {"ranks": pickle.dumps(states)}

    def load_state_dict(self, state_dict: dict) -> None:
        states = pickle.loads(state_dict["ranks"])
        world_size = dist.get_world_size() if _distributed() else 1
        if len(states) != world_size:
            logger.warning(
                f"The checkpoint holds RNG states of {len(states)} ranks, this run has {world_size}: "
                "the random generators keep their seeded state"
            )
            return
        _set_local_state(states[dist.get_rank() if _distributed() else 0])
