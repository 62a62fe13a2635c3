"""Fixtures of the checkpoint tests: a small model, flame.train's main run in this process, and the stand-in hub."""

import json
from pathlib import Path

import pytest

from flame.config.job_config import ASSETS
from tests.checkpoint.hub_server import FakeHub
from tests.trainer_helpers import TINY, free_port

TINY_MODEL = ASSETS / "tiny.json"
HUB_TOKEN = "hf_flameTestToken4c9e1d"


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


@pytest.fixture
def hub(monkeypatch):
    """The stand-in hub (hub_server.py), reached through HF_ENDPOINT with HUB_TOKEN, online: huggingface_hub reads
    HF_HUB_OFFLINE once, at its import, which a conftest that sets it (tests/data) may have preceded."""
    import huggingface_hub.constants as constants

    with FakeHub(HUB_TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield server
