"""One run per dump folder: the lock, its stale take-over, and a second train.sh on a held folder."""

import json
import os
import socket
import subprocess
import sys

import pytest

from flame.checkpoint.lock import DumpFolderInUse, DumpFolderLock, hold_for_trainer
from tests.checkpoint.helpers import run


@pytest.fixture
def other_process():
    """A live process of this host that is not this test."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process.pid
    process.kill()
    process.wait()


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_held_folder_is_refused_naming_the_holder(tmp_path, other_process):
    DumpFolderLock(tmp_path, pid=other_process).acquire()
    holder = json.loads((tmp_path / "flame.lock").read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == other_process and holder["started"]
    with pytest.raises(DumpFolderInUse, match=rf"is in use by another run \(pid {other_process} on "):
        DumpFolderLock(tmp_path).acquire()
    DumpFolderLock(tmp_path).release()  # not ours: stays
    assert (tmp_path / "flame.lock").is_file()
    DumpFolderLock(tmp_path, pid=other_process).release()
    assert not (tmp_path / "flame.lock").exists()


def test_another_hosts_lock_is_never_taken_over(tmp_path):
    (tmp_path / "flame.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "then"}))
    with pytest.raises(DumpFolderInUse, match=r"pid 1 on elsewhere, started then\); .* delete .*flame.lock"):
        DumpFolderLock(tmp_path).acquire()


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    DumpFolderLock(tmp_path, pid=dead_pid()).acquire()
    lock = DumpFolderLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / "flame.lock").read_text())["pid"] == os.getpid()
    assert "no longer running" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["flame.lock"]
    lock.release()


def test_a_trainer_takes_the_lock_unless_its_launcher_holds_it(tmp_path, other_process, monkeypatch):
    lock = hold_for_trainer(str(tmp_path))
    assert json.loads((tmp_path / "flame.lock").read_text())["pid"] == os.getpid()
    lock.release()
    DumpFolderLock(tmp_path, pid=other_process).acquire()
    with pytest.raises(DumpFolderInUse):
        hold_for_trainer(str(tmp_path))
    monkeypatch.setenv("FLAME_DUMP_LOCK", str((tmp_path / "flame.lock").resolve()))
    assert hold_for_trainer(str(tmp_path)) is None


def test_train_sh_refuses_a_folder_in_use_in_one_line(tmp_path, other_process):
    DumpFolderLock(tmp_path / "run", pid=other_process).acquire()
    result = run(["bash", "train.sh", "--job.dump_folder", str(tmp_path / "run")], env={"NGPU": "1"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'run'} is in use by another run (pid {other_process} on {socket.gethostname()}, "
        f"started {json.loads((tmp_path / 'run' / 'flame.lock').read_text())['started']}); give this run another "
        f"--job.dump_folder, or delete {tmp_path / 'run' / 'flame.lock'} if that run is gone"
    ]
    assert not (tmp_path / "run" / "logs").exists()  # nothing was written before the refusal
