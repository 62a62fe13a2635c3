"""Which step directories count as checkpoints, and the one-line errors for the others."""

import pytest

from flame.checkpoint.layout import (
    CheckpointError,
    checkpoint_folder,
    config_differences,
    latest_step,
    list_steps,
    resolve_step_dir,
)


def make(folder, name, complete=True):
    path = folder / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"")
    if complete:
        (path / ".metadata").write_bytes(b"")
    return path


def test_only_exact_complete_step_directories_count(tmp_path):
    folder = tmp_path / "checkpoint"
    make(folder, "step-2")
    make(folder, "step-10")
    make(folder, "step-12", complete=False)  # a save that was killed
    make(folder, "step-99.tmp")  # torchtitan's search would take these two for step 99
    make(folder, "old-step-99")
    (folder / "step-50").write_text("a file")
    assert list_steps(folder) == {2: True, 10: True, 12: False}
    assert latest_step(folder) == 10
    assert resolve_step_dir(folder, -1) == folder / "step-10"
    assert resolve_step_dir(folder, 2) == folder / "step-2"
    with pytest.raises(
        CheckpointError, match=r"step-12 is incomplete .*complete: 2, 10; interrupted saves: 12"
    ):
        resolve_step_dir(folder, 12)
    with pytest.raises(CheckpointError, match="there is no checkpoint step-3"):
        resolve_step_dir(folder, 3)
    assert latest_step(tmp_path / "none") == -1


def test_checkpoint_folder_of_a_dump_folder(tmp_path):
    make(tmp_path / "dump" / "checkpoint", "step-1")
    assert checkpoint_folder(tmp_path / "dump") == tmp_path / "dump" / "checkpoint"
    assert checkpoint_folder(tmp_path / "dump" / "checkpoint") == tmp_path / "dump" / "checkpoint"
    make(tmp_path / "other" / "ckpt", "step-1")  # a run with --checkpoint.folder ckpt
    (tmp_path / "other" / "tb").mkdir()
    assert checkpoint_folder(tmp_path / "other") == tmp_path / "other" / "ckpt"
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_folder(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_step_dir(tmp_path / "empty", -1)


def test_config_differences_ignore_fields_that_leave_the_function_alone():
    saved = {"hidden_size": 64, "attn_impl": "parallel_softpick_attn", "initializer_range": 0.02}
    current = {"hidden_size": 64, "attn_impl": "parallel_attn", "initializer_range": 0.006}
    assert config_differences(saved, current) == ["attn_impl: 'parallel_softpick_attn' -> 'parallel_attn'"]
