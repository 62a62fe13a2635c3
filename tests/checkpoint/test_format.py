"""flame.json records flame's version and the checkpoint format; a full checkpoint of another format stops in one
line naming both versions."""

import json

import pytest
import torch

from flame import __version__
from flame.checkpoint.dcp_io import save_model_tensors
from flame.checkpoint.layout import FORMAT, CheckpointError, read_sidecar, write_sidecar
from flame.checkpoint.manager import CheckpointManager


def checkpoint(path, full: bool, sidecar: dict):
    tensors = {"w": torch.ones(2)} | ({"train_state.step": torch.zeros(1)} if full else {})
    save_model_tensors(path, tensors)
    (path / "flame.json").write_text(json.dumps(sidecar))
    return path


def test_the_sidecar_records_version_and_format(tmp_path):
    write_sidecar(tmp_path, {"model_type": "transformer"}, None)
    sidecar = read_sidecar(tmp_path)
    assert (sidecar["flame_version"], sidecar["format"]) == (__version__, FORMAT)
    CheckpointManager._check_format(tmp_path, sidecar)  # its own format loads


def test_other_formats_stop_in_one_line(tmp_path):
    old = checkpoint(tmp_path / "old", full=True, sidecar={"model_config": {}, "tokenizer": None})
    with pytest.raises(CheckpointError, match=rf"format 0 \(written by a flame before 0.1.0; its RNG and dataloader "
                                              rf"state are pickled\), this flame {__version__} reads format 1: start "
                                              r"a new run from its weights with --checkpoint.initial_load_path"):  # fmt: skip
        CheckpointManager._check_format(old, read_sidecar(old))
    seed = checkpoint(tmp_path / "seed", full=False, sidecar={"model_config": {}, "tokenizer": None})
    CheckpointManager._check_format(seed, read_sidecar(seed))  # model-only: tensors alone, every format alike
    newer = checkpoint(tmp_path / "newer", full=True, sidecar={"flame_version": "9.0", "format": FORMAT + 1})
    with pytest.raises(CheckpointError, match=rf"has format 2 \(written by flame 9.0\); this flame {__version__} "
                                              r"reads format 1: update flame"):  # fmt: skip
        CheckpointManager._check_format(newer, read_sidecar(newer))
