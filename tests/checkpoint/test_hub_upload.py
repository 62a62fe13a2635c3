"""Hub upload of checkpoints (--checkpoint.hf_upload_enabled) against a stand-in hub (hub_server.py) that
huggingface_hub reaches through HF_ENDPOINT: step folders in one repository per run, pruned by keep_latest_k,
uploads in the background with a bounded wait at exit, failures as one warning line, and the token never logged."""

import logging
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from flame.config.job_config import ASSETS
from tests.checkpoint.conftest import HUB_TOKEN as TOKEN

REPO = "tester/tiny-run"
TINY_MODEL = ASSETS / "tiny.json"


UPLOAD = ["--checkpoint.hf_upload_enabled", "--checkpoint.hf_repo_base_name", REPO]


def local_files(step_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(step_dir).as_posix(): p.read_bytes() for p in step_dir.rglob("*") if p.is_file()}


def test_checkpoints_upload_as_step_folders_of_one_repo_pruned_and_resumed(hub, train, tmp_path):
    dump = tmp_path / "run"
    flags = [*UPLOAD, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"]
    status, log = train(dump, *flags, "--training.steps", "6")
    assert status == 0, log
    assert hub.steps(REPO) == [4, 6]  # step-2 was uploaded, then pruned in step-6's commit
    assert [message for _, message in hub.commits] == [
        "step-2 (dcp)",
        "step-4 (dcp)",
        "step-6 (dcp), removing step-2",
    ]
    checkpoint = dump / "checkpoint"
    for step in (4, 6):
        assert hub.folder(REPO, f"step-{step}") == local_files(checkpoint / f"step-{step}")
    assert {".metadata", "manifest.json", "flame.json"} <= set(hub.folder(REPO, "step-6"))
    assert "removed step-2 from the hub (checkpoint.keep_latest_k 2)" in log
    assert not (checkpoint / "hub-upload").exists()  # nothing left staged

    # The resumed run (new launch, same dump folder) uploads into the same repository and prunes it. Its step-8
    # save is asynchronous (torchtitan saves the last step synchronously): handed over once written.
    status, log2 = train(dump, *flags, "--training.steps", "10", "--checkpoint.async_mode", "async")
    assert status == 0, log2
    assert "Training starts at step 7" in log2
    assert list(hub.repos) == [REPO] and hub.steps(REPO) == [8, 10]
    assert [message for _, message in hub.commits[3:]] == [
        "step-8 (dcp), removing step-4",
        "step-10 (dcp), removing step-6",
    ]
    for step in (8, 10):
        assert hub.folder(REPO, f"step-{step}") == local_files(checkpoint / f"step-{step}")
    assert TOKEN not in log + log2


def test_hf_format_uploads_the_export_of_the_step(hub, train, tmp_path):
    from flame.hf.export import export_checkpoint

    dump = tmp_path / "run"
    status, log = train(dump, *UPLOAD, "--checkpoint.hf_upload_format", "hf", "--training.steps", "1")
    assert status == 0, log
    export_checkpoint(dump, 1, tmp_path / "export")
    uploaded = hub.folder(REPO, "step-1")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(uploaded)
    assert uploaded == local_files(tmp_path / "export")
    assert TOKEN not in log


def test_unreachable_hub_is_one_warning_and_the_run_finishes(monkeypatch, train, tmp_path):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    status, log = train(tmp_path / "run", *UPLOAD, "--training.steps", "2", "--checkpoint.interval", "2")
    assert status == 0, log
    warnings = [line for line in log.splitlines() if "Hub upload" in line]
    assert len(warnings) == 1, log
    assert re.search(
        r"Hub upload of checkpoint step-2 to tester/tiny-run failed \(\w+: .+\); training goes on",
        warnings[0],
    )
    assert (
        "Training completed" in log and (tmp_path / "run" / "checkpoint" / "step-2" / ".metadata").is_file()
    )
    assert TOKEN not in log


def test_after_a_preemption_signal_the_exit_does_not_wait_for_uploads(
    hub, make_trainer, small_model, tmp_path, caplog
):
    from flame.checkpoint.preemption import Preempted

    dump = tmp_path / "run"
    trainer = make_trainer(*UPLOAD, "--model.config", small_model, "--checkpoint.enable", "--checkpoint.interval",
                           "100", "--checkpoint.preempt_signals", "SIGUSR1", "--training.steps", "6", dump=dump)  # fmt: skip
    step = trainer.train_step

    def signalled_step(data_iterator):
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        step(data_iterator)

    trainer.train_step = signalled_step
    hub.commit_gate.clear()  # the upload of the preemption save cannot finish
    with pytest.raises(Preempted):
        trainer.train()
    start = time.perf_counter()
    trainer.close()
    assert (
        time.perf_counter() - start < 30
    )  # not checkpoint.hf_upload_timeout (600 s), nor the held commit (60 s)
    assert "Hub upload of step-2 to tester/tiny-run still pending after 0 s" in caplog.text
    (staged,) = (dump / "checkpoint" / "hub-upload").iterdir()  # for the next launch
    assert (staged / "step-2" / ".metadata").is_file()
    hub.commit_gate.set()
    trainer.hub_uploader._thread.join(30)


def fake_checkpoint(folder: Path, step: int) -> Path:
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(f"metadata {step}".encode())
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    return path


def test_uploads_run_behind_training_and_the_exit_wait_is_bounded(hub, tmp_path, caplog):
    from flame.checkpoint.hub_upload import HubUploader

    folder = tmp_path / "checkpoint"
    uploader = HubUploader(REPO, folder)
    hub.commit_gate.clear()  # the hub holds every commit until the gate opens
    start = time.perf_counter()
    uploader.submit(1, fake_checkpoint(folder, 1))
    assert hub.commits_waiting.acquire(
        timeout=30
    )  # step-1's commit is in flight, held by the hub (60 s at most)
    uploader.submit(2, fake_checkpoint(folder, 2))  # queued behind it
    # Both submits returned while the hub held the first commit: a submit that waited for it would take 60 s.
    assert time.perf_counter() - start < 30 and uploader.pending() == [1, 2] and hub.commits == []
    assert uploader.close(timeout=0.2) == [1, 2]
    assert "Hub upload of step-1, step-2 to tester/tiny-run still pending after 0.2 s" in caplog.text
    hub.commit_gate.set()
    uploader._thread.join(30)  # in a real run the process ends here; this thread finishes for the test's sake
    assert hub.steps(REPO) == [1, 2] and TOKEN not in caplog.text


def test_a_queue_longer_than_keep_latest_k_skips_what_would_be_pruned(hub, tmp_path):
    from flame.checkpoint.hub_upload import HubUploader

    folder = tmp_path / "checkpoint"
    uploader = HubUploader(REPO, folder, keep_latest_k=2)
    hub.commit_gate.clear()
    uploader.submit(1, fake_checkpoint(folder, 1))
    assert hub.commits_waiting.acquire(timeout=30)
    for step in (2, 3, 4):  # saved while step-1 uploads: step-2 would be pruned by step-3 and step-4
        uploader.submit(step, fake_checkpoint(folder, step))
    hub.commit_gate.set()
    assert uploader.close(timeout=30) == []
    assert [message for _, message in hub.commits] == [
        "step-1 (dcp)",
        "step-3 (dcp)",
        "step-4 (dcp), removing step-1",
    ]
    assert hub.steps(REPO) == [3, 4]


def test_a_launch_uploads_what_the_last_one_left_staged(hub, tmp_path, caplog):
    from flame.checkpoint.hub_upload import STAGING, HubUploader

    caplog.set_level(logging.INFO)
    folder = tmp_path / "checkpoint"
    fake_checkpoint(folder / STAGING / "1700000000000000000", 5)  # left by a launch that ended mid-upload
    fake_checkpoint(folder / STAGING / "1700000000000000001.linking", 6)  # one that ended while staging it
    uploader = HubUploader(REPO, folder)
    assert uploader.close(timeout=30) == []
    assert "Uploading step-5 left pending by the last launch" in caplog.text
    assert hub.steps(REPO) == [5] and not (folder / STAGING).exists()


def test_a_rejected_token_is_one_warning_without_the_token(hub, tmp_path, caplog, monkeypatch):
    from flame.checkpoint.hub_upload import HubUploader

    monkeypatch.setenv("HF_TOKEN", "hf_wrongToken0000")
    uploader = HubUploader(REPO, tmp_path / "checkpoint")
    uploader.submit(3, fake_checkpoint(tmp_path / "checkpoint", 3))
    assert uploader.close(timeout=30) == []
    lines = [r.getMessage() for r in caplog.records if "Hub upload" in r.getMessage()]
    assert len(lines) == 1 and "401" in lines[0] and "hf_wrongToken0000" not in caplog.text
    assert REPO not in hub.repos


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--checkpoint.hf_upload_enabled"], "checkpoint.hf_upload_enabled needs the hub repository: pass "
         "--checkpoint.hf_repo_base_name <user/name>"),
        ([*UPLOAD, "--checkpoint.no-enable"], "checkpoint.hf_upload_enabled uploads checkpoints, but "
         "checkpoint.enable is off; turn checkpoints on"),
        (["--checkpoint.hf_upload_enabled", "--checkpoint.hf_repo_base_name", "a/b/c"],
         "checkpoint.hf_repo_base_name must be a hub repository name 'user/name' (letters, digits, '-', '_', '.'), "
         "got 'a/b/c'"),
        ([*UPLOAD, "--checkpoint.hf_upload_format", "hf", "--checkpoint.export_dtype", "float16"],
         "checkpoint.hf_upload_format hf exports in float32 or bfloat16, got checkpoint.export_dtype float16"),
        ([*UPLOAD, "--checkpoint.hf_upload_timeout", "-1"],
         "checkpoint.hf_upload_timeout must be >= 0 seconds, got -1.0"),
    ],
)  # fmt: skip
def test_bad_upload_options_are_one_line(flags, message):
    from flame.config import parse_args
    from flame.config.checks import validate_job
    from flame.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        validate_job(parse_args(flags))
    assert str(info.value) == message
