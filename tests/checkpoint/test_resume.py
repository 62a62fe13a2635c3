"""Exact resume and crash safety on 2 CPU ranks (FSDP over gloo, 2 dataloader workers per rank, async saves).

One uninterrupted run of 6 steps against the same job in two pieces: killed while step 4's checkpoint was being
written, then resumed from the last complete checkpoint (step 2). Every step's loss equals the uninterrupted run's
bit for bit. (``--training.stop_at_step`` and its resume: tests/train/test_step.py.)
"""

import pytest

from flame.checkpoint.layout import CheckpointError, latest_step, list_steps, read_sidecar, resolve_step_dir
from tests.checkpoint.helpers import killed_run, output, train_sh
from tests.trainer_helpers import tensorboard_scalars

pytestmark = pytest.mark.slow

# Real prose (the default corpus), a learning rate that changes every step, a checkpoint every 2 steps.
JOB = ["--training.steps", "6", "--training.seq_len", "64", "--training.batch_size", "2",
       "--training.num_workers", "2", "--training.seed", "7", "--lr_scheduler.warmup_steps", "2",
       "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"]  # fmt: skip


def test_interrupted_runs_repeat_the_uninterrupted_run(tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    result = train_sh(uninterrupted, *JOB, export_hf=False)
    assert result.returncode == 0, output(result, uninterrupted)
    expected = tensorboard_scalars(uninterrupted, "loss/train")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    dump = tmp_path / "run"
    folder = dump / "checkpoint"
    # Killed after every rank wrote step 4's data but before its .metadata.
    killed = killed_run(dump, "before_metadata:4", *JOB, "--metrics.save_tb_folder", "tb_killed")
    assert killed.returncode != 0, output(killed, dump)
    assert list_steps(folder) == {2: True, 4: False}
    assert any((folder / "step-4.partial").glob("*.distcp")) and not (folder / "step-4").exists()
    assert latest_step(folder) == 2
    with pytest.raises(CheckpointError, match="step-4 is incomplete"):
        resolve_step_dir(folder, 4)
    sidecar = read_sidecar(folder / "step-2")
    assert sidecar["model_config"]["model_type"] == "transformer" and sidecar["tokenizer"]

    resumed = train_sh(dump, *JOB, "--metrics.save_tb_folder", "tb_resumed", export_hf=False)
    assert resumed.returncode == 0, output(resumed, dump)
    assert "step-2" in resumed.stdout and "Training starts at step 3" in resumed.stdout
    pieces = {
        "killed": tensorboard_scalars(dump, "loss/train", folder="tb_killed"),
        "resumed": tensorboard_scalars(dump, "loss/train", folder="tb_resumed"),
    }
    assert 4 in pieces["killed"] and sorted(pieces["resumed"]) == [3, 4, 5, 6]
    for piece, losses in pieces.items():
        for step, loss in losses.items():
            assert loss == expected[step], (piece, step, losses, expected)
    # keep_latest_k=2 counts complete checkpoints; the interrupted step-4 was rewritten whole.
    assert list_steps(folder) == {4: True, 6: True}
