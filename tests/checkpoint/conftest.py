"""Fixtures of the checkpoint tests that train: a small model, and flame.train's main run in this process."""

import json
from pathlib import Path

import pytest

from flame.config.job_config import ASSETS
from tests.trainer_helpers import TINY, free_port

TINY_MODEL = ASSETS / "tiny.json"


@pytest.fixture
def small_model(tmp_path) -> str:
    """A model smaller than the default tiny one: checkpoints of 7 MiB instead of 61 upload in a fraction of the
    time."""
    model = tmp_path / "small.json"
    config = json.loads(TINY_MODEL.read_text())
    model.write_text(json.dumps({**config, "hidden_size": 64, "num_hidden_layers": 2}))
    return str(model)


@pytest.fixture
def train(monkeypatch, capfd, small_model):
    """train(dump, *flags) -> (exit status, everything the run printed): flame.train's main in this process."""
    from flame.train.trainer import main

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "localhost"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)

    def run(dump: Path, *flags: str) -> tuple[int, str]:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ["--job.dump_folder", str(dump), *TINY, "--model.config", small_model, "--checkpoint.enable"]
        status = main([*argv, *flags])
        out, err = capfd.readouterr()
        return status, out + err

    yield run
    import torch

    torch.use_deterministic_algorithms(False)
