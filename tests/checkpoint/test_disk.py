"""A disk without room for a checkpoint: the save is skipped in one line, the run goes on, nothing is half-written;
a disk that fills up during a save stops the run in one line with the earlier checkpoints intact."""

import errno
import shutil
from collections import namedtuple

import pytest

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
