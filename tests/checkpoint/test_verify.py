"""Damaged checkpoints: what verification finds, the fallback of a resumed run, and the verify command."""

import json

import pytest
import torch

from flame.checkpoint.__main__ import main as checkpoint_cli
from flame.checkpoint.dcp_io import save_model_tensors
from flame.checkpoint.layout import CheckpointError, list_steps
from flame.checkpoint.verify import checkpoint_problem, write_manifest


def saved(path, manifest=True):
    save_model_tensors(path, {"a": torch.arange(1000.0), "b": torch.ones(50, 3)})
    if manifest:
        write_manifest(path)
    return path


def data_file(path):
    return next(path.glob("*.distcp"))


def test_a_whole_checkpoint_verifies(tmp_path):
    path = saved(tmp_path / "step-1")
    assert checkpoint_problem(path) is None
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert set(files) == {".metadata", data_file(path).name}


def test_truncated_changed_and_missing_files_are_named(tmp_path):
    truncated = saved(tmp_path / "truncated")
    data = data_file(truncated)
    data.write_bytes(data.read_bytes()[:100])
    size = json.loads((truncated / "manifest.json").read_text())["files"][data.name]["size"]
    assert checkpoint_problem(truncated) == f"{data.name} is 100 bytes, {size} when saved"

    changed = saved(tmp_path / "changed")
    data = data_file(changed)
    content = bytearray(data.read_bytes())
    content[-1] ^= 0xFF
    data.write_bytes(bytes(content))
    assert checkpoint_problem(changed) == f"{data.name} has changed since the save (SHA-256 differs)"
    assert checkpoint_problem(changed, checksums=False) is None  # same size: only the checksum sees it

    missing = saved(tmp_path / "missing")
    data_file(missing).unlink()
    assert checkpoint_problem(missing).endswith(".distcp is missing")


def test_without_a_manifest_the_metadata_is_the_reference(tmp_path):
    path = saved(tmp_path / "old", manifest=False)
    assert checkpoint_problem(path) is None
    data = data_file(path)
    data.write_bytes(data.read_bytes()[:100])
    assert "shorter than the" in checkpoint_problem(path)
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    assert checkpoint_problem(path).startswith("its .metadata cannot be read")


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(make_trainer, tmp_path, caplog):
    dump = tmp_path / "run"
    flags = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    make_trainer(*flags, dump=dump).train()
    folder = dump / "checkpoint"
    assert list_steps(folder) == {2: True, 4: True}
    assert not list(folder.glob("*.partial")) and (folder / "step-4" / "manifest.json").is_file()
    data = data_file(folder / "step-4")
    data.write_bytes(data.read_bytes()[:-10])

    with pytest.raises(
        CheckpointError, match=r"step-4 is damaged: __0_0.distcp is \d+ bytes, \d+ when saved"
    ):
        make_trainer(*flags, "--checkpoint.load_step", "4", dump=dump).train()

    resumed = make_trainer(*flags, "--training.steps", "5", dump=dump)
    resumed.checkpointer.load(step=-1)
    assert resumed.step == 2
    assert any(
        "Skipping checkpoint" in r.message and "step-4: __0_0.distcp is" in r.message for r in caplog.records
    )

    assert checkpoint_cli(["verify", str(dump)]) == 1
    data_file(folder / "step-2").unlink()  # nothing verifies: a resumed run stops instead of starting over
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies \(step-4: .*; step-2: .*\)"):
        make_trainer(*flags, dump=dump).checkpointer.load(step=-1)


def test_verify_command_reports_every_step(tmp_path, capsys):
    folder = tmp_path / "dump" / "checkpoint"
    saved(folder / "step-3")
    saved(folder / "step-6")
    (folder / "step-9.partial").mkdir()
    assert checkpoint_cli(["verify", str(tmp_path / "dump")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{folder}/step-3: ok",
        f"{folder}/step-6: ok",
        f"{folder}/step-9.partial: interrupted save (never loaded)",
        "a resumed run loads step-6",
    ]
    assert checkpoint_cli(["verify", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
