"""Checkpoint retention as upstream flame: every checkpoint is kept unless keep_latest_k is set, and the start of
the log says which policy the run has."""

import logging

import pytest
from torch import nn

from flame.config import parse_args


@pytest.mark.parametrize(
    "flags, policy",
    [
        ([], "keeping all of them (checkpoint.keep_latest_k 0)"),
        (["--checkpoint.keep_latest_k", "3"], "keeping the latest 3 (checkpoint.keep_latest_k 3)"),
    ],
)
def test_start_banner_says_the_retention_policy(tmp_path, caplog, flags, policy):
    from flame.checkpoint.manager import CheckpointManager

    toml = tmp_path / "job.toml"
    toml.write_text("[checkpoint]\ninterval = 50\n")  # a job file silent on keep_latest_k
    config = parse_args(["--job.config_file", str(toml), *flags])
    with caplog.at_level(logging.INFO):
        manager = CheckpointManager(
            dataloader=None,
            model_parts=[nn.Linear(2, 2)],
            optimizers=None,
            lr_schedulers=None,
            states={},
            checkpoint_config=config.checkpoint,
            sd_adapter=None,
            base_folder=str(tmp_path),
        )
    manager.close()
    assert f"Checkpoints every 50 steps in {tmp_path}/checkpoint, {policy}" in caplog.text
