"""A disk without room for a checkpoint: the save is skipped in one line, the run goes on, nothing is half-written;
a disk that fills up during a save stops the run in one line with the earlier checkpoints intact."""

import errno
import shutil
from collections import namedtuple

import pytest
import torch

from flame.checkpoint import manager
from flame.checkpoint.layout import CheckpointError, list_steps

Usage = namedtuple("Usage", "total used free")
FLAGS = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def test_no_room_skips_the_save_and_the_next_one_tries_again(make_trainer, tmp_path, monkeypatch, caplog):
    dump = tmp_path / "run"
    real = shutil.disk_usage
    full = {"yes": True}
    monkeypatch.setattr(manager.shutil, "disk_usage", lambda p: Usage(1, 1, 1000) if full["yes"] else real(p))
    trainer = make_trainer(*FLAGS, dump=dump)
    step = trainer.train_step

    def free_after_step_2(data_iterator):
        full["yes"] = trainer.step <= 2
        step(data_iterator)

    trainer.train_step = free_after_step_2
    trainer.train()
    assert trainer.step == 4
    assert list_steps(dump / "checkpoint") == {4: True}  # step 2 skipped, nothing partial left
    assert [p.name for p in (dump / "checkpoint").iterdir()] == ["step-4"]
    assert any(r.message.startswith("Not saving checkpoint step-2: it needs about ") for r in caplog.records)


def test_a_disk_that_fills_up_during_the_save_stops_in_one_line(make_trainer, tmp_path, monkeypatch):
    dump = tmp_path / "run"
    trainer = make_trainer(*FLAGS, dump=dump)
    original = trainer.checkpointer.dcp_save

    def enospc(*args, **kwargs):
        if trainer.step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer.checkpointer, "dcp_save", enospc)
    with pytest.raises(
        CheckpointError, match=r"filled up while saving step-4; that save stays step-4.partial"
    ):
        trainer.train()
    assert list_steps(dump / "checkpoint") == {2: True, 4: False}


def test_parameters_that_turned_nan_stop_the_run_at_the_save_and_the_earlier_checkpoints_stay(
    make_trainer, tmp_path
):
    # keep_latest_k 2: saving the diverged model twice would have deleted the last good checkpoint.
    dump = tmp_path / "run"
    trainer = make_trainer("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2",
                           "--training.steps", "6", dump=dump)  # fmt: skip
    step = trainer.train_step

    def diverge_at_step_3(data_iterator):
        step(data_iterator)
        if trainer.step == 3:
            parameter = next(trainer.model_parts[0].parameters())
            with torch.no_grad():
                parameter.view(-1)[0] = float("nan")

    trainer.train_step = diverge_at_step_3
    with pytest.raises(
        CheckpointError, match=r"NaN or inf at step 4 \(1 on a rank: .+\), so step-4 is not saved"
    ) as e:
        trainer.train()
    assert "step-2 is the newest checkpoint: resume from it with a lower learning rate" in str(e.value)
    assert list_steps(dump / "checkpoint") == {2: True}
