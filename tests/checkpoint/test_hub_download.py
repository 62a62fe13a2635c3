"""Downloading a run's checkpoints from the hub (download_checkpoint.py, the softpick fork's tool) against the
stand-in hub (hub_server.py): uploaded steps come back byte for byte and a run resumes from them; a step is added
only once it verifies; steps already there, HF exports and absent steps are handled with one line each."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flame.checkpoint.dcp_io import save_model_tensors
from flame.checkpoint.hub_download import STAGING, download_checkpoints, hub_steps
from flame.checkpoint.verify import write_manifest
from flame.cli.download_checkpoint import main
from tests.checkpoint.conftest import HUB_TOKEN as TOKEN
from tests.checkpoint.hub_server import FakeHub
from tests.checkpoint.test_hub_upload import REPO, UPLOAD, local_files

REPO_ROOT = Path(__file__).resolve().parents[2]


def checkpoint_files(tmp_path: Path, seed: int) -> dict[str, bytes]:
    """The files of a small DCP checkpoint with a manifest, as a repository's step folder holds them."""
    folder = tmp_path / f"made-{seed}"
    generator = torch.Generator().manual_seed(seed)
    save_model_tensors(
        folder, {"w": torch.randn(5, 3, generator=generator), "b": torch.randn(7, generator=generator)}
    )
    write_manifest(folder)
    return local_files(folder)


def put_steps(hub: FakeHub, steps: dict[int, dict[str, bytes]]) -> None:
    hub.repos[REPO] = {
        f"step-{step}/{name}": data for step, files in steps.items() for name, data in files.items()
    }


def test_uploaded_steps_come_back_byte_for_byte_and_the_run_resumes_from_them(hub, train, tmp_path):
    status, log = train(tmp_path / "run", *UPLOAD, "--checkpoint.interval", "2", "--training.steps", "4")
    assert status == 0, log
    elsewhere = tmp_path / "elsewhere"  # another machine's dump folder, empty
    assert main(["--repo_id", REPO, "--experiment_checkpoint_folder", str(elsewhere)]) == 0
    for step in (2, 4):
        assert local_files(elsewhere / "checkpoint" / f"step-{step}") == hub.folder(REPO, f"step-{step}")
    assert not (elsewhere / "checkpoint" / STAGING).exists()
    status, log = train(elsewhere, "--training.steps", "6")
    assert status == 0, log
    assert "Training starts at step 5" in log


def test_only_the_steps_asked_for_and_kept_local_steps(hub, tmp_path, capsys):
    put_steps(hub, {3: checkpoint_files(tmp_path, 3), 12: checkpoint_files(tmp_path, 12)})
    folder = tmp_path / "run" / "checkpoint"
    assert download_checkpoints(REPO, folder, [-1]) == [12]
    assert sorted(p.name for p in folder.iterdir()) == ["step-12"]
    (folder / "step-12" / "marker").write_text("local")  # a step already there is not touched
    assert download_checkpoints(REPO, folder) == [3]
    assert (folder / "step-12" / "marker").read_text() == "local"
    assert "step-12 is in" in capsys.readouterr().out


def test_a_step_that_does_not_verify_is_not_added(hub, tmp_path):
    files = checkpoint_files(tmp_path, 1)
    data = next(name for name in files if name.endswith(".distcp"))
    files[data] = files[data][:-1] + bytes([files[data][-1] ^ 1])  # one flipped bit, same size
    put_steps(hub, {1: files, 2: checkpoint_files(tmp_path, 2)})
    folder = tmp_path / "run" / "checkpoint"
    with pytest.raises(Exception, match=r"step-1 of tester/tiny-run does not verify: .*SHA-256 differs"):
        download_checkpoints(REPO, folder)
    assert not (folder / "step-1").exists()
    assert download_checkpoints(REPO, folder, [2]) == [2]


def test_hf_exports_are_skipped_and_absent_steps_refused(hub, tmp_path, capsys):
    put_steps(
        hub,
        {1: {"config.json": b"{}", "model.safetensors": b"x"}, 2: checkpoint_files(tmp_path, 2)},
    )
    folder = tmp_path / "run" / "checkpoint"
    assert download_checkpoints(REPO, folder) == [2]
    assert (
        "step-1 of tester/tiny-run is an HF export, not a DCP checkpoint: skipped" in capsys.readouterr().out
    )
    with pytest.raises(Exception, match="has no step 7; it has steps 1, 2"):
        download_checkpoints(REPO, folder, [7])


def test_hub_steps_reads_step_folders_only():
    files = ["README.md", "step-10/.metadata", "step-10/__0_0.distcp", "step-2/a/b", "steps/x", "step-3"]
    assert hub_steps(files) == {10: ["step-10/.metadata", "step-10/__0_0.distcp"], 2: ["step-2/a/b"]}


def test_the_forks_command_ends_on_one_line_for_a_missing_repository(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "download_checkpoint.py", "--repo_id", "tester/absent",
               "--experiment_checkpoint_folder", str(tmp_path / "run")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: hub repository tester/absent not found, or not readable with this machine's token"
        )
    )
