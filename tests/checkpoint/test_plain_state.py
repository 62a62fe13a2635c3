"""What flame writes into a checkpoint besides tensors is plain data: RNG states are tensors, the dataloader's
position is JSON text, and loading refuses pickled objects."""

import io
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import flame
from flame.checkpoint.manager import PlainDataLoadPlanner
from flame.checkpoint.rng import RNGState
from flame.data.loader import decode_state, encode_state


def test_rng_state_is_tensors_and_restores_every_generator():
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    random.gauss(0, 1)  # a cached Gaussian in Python's generator
    np.random.standard_normal()
    state = RNGState().state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    RNGState().load_state_dict(state)
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_dataloader_state_round_trips_as_json():
    state = {
        "packer": {"leftover": np.arange(5, dtype=np.int32)},
        "position": 7,
        "done": False,
        "names": ["a"],
    }
    text = encode_state(state)
    assert isinstance(text, str)
    back = decode_state(text)
    assert back["packer"]["leftover"].dtype == np.int32
    assert back["packer"]["leftover"].tolist() == [0, 1, 2, 3, 4]
    assert {k: v for k, v in back.items() if k != "packer"} == {"position": 7, "done": False, "names": ["a"]}
    with pytest.raises(TypeError, match="object in the dataloader state cannot be stored as plain data"):
        encode_state({"x": object()})


class Payload:
    def __reduce__(self):
        return (print, ("code from the checkpoint ran",))


def test_loading_refuses_pickled_objects(capsys):
    hostile = io.BytesIO()
    torch.save(Payload(), hostile)
    hostile.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        PlainDataLoadPlanner().load_bytes(None, hostile)
    assert "code from the checkpoint ran" not in capsys.readouterr().out


def test_flame_never_unpickles():
    """No module of flame imports pickle (DCP's own .metadata reading is the one unpickling left: docs/checkpoints.md)."""
    sources = Path(flame.__file__).parent.rglob("*.py")
    offenders = [
        str(p) for p in sources if re.search(r"^\s*(import pickle|from pickle )", p.read_text(), re.M)
    ]
    assert offenders == []
