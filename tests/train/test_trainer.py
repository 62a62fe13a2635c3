"""The rank process: it ends with the torchrun that started it, and exports the finished run when train.sh asks."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.checkpoint.helpers import REPO
from tests.trainer_helpers import TINY, free_port


def processes_naming(text: str) -> list[int]:
    """The pids of the processes whose command line contains ``text``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if text in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc (Linux)")
def test_a_sigkill_to_train_sh_s_process_group_ends_the_ranks(tmp_path):
    """torchrun starts each rank in a session of its own: killed with its process group (a timeout's SIGKILL),
    it cannot stop them, and only their parent-death signal does."""
    dump = tmp_path / "run"
    process = subprocess.Popen(
        ["bash", "train.sh", "--job.dump_folder", str(dump), "--training.steps", "2000", "--training.seq_len", "64",
         "--training.batch_size", "2", "--checkpoint.interval", "2000", "--metrics.log_freq", "1"],
        cwd=REPO, env={**os.environ, "NGPU": "1", "PYTHONUNBUFFERED": "1", "FLAME_EXPORT_HF": "0"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        for line in process.stdout:  # the console shows rank 0's log as it is written
            if re.search(r"step +2/2000 ", line):
                break
        else:
            raise AssertionError(f"the run ended before step 2: {process.wait()}")
        ranks = [pid for pid in processes_naming(str(dump)) if os.getpgid(pid) != process.pid]
        assert ranks, "no rank outside train.sh's process group"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and set(ranks) & set(processes_naming(str(dump))):
            time.sleep(0.2)
        survivors = set(ranks) & set(processes_naming(str(dump)))
        assert not survivors, f"ranks {sorted(survivors)} outlived torchrun"
    finally:
        for pid in processes_naming(str(dump)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_rank_0_exports_the_finished_run_when_train_sh_asks(tmp_path):
    """FLAME_EXPORT_HF_AT_END=1 (train.sh's end-of-run export): after the run, rank 0 converts its final checkpoint
    into the dump folder, as the converter would."""
    dump = tmp_path / "run"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port()), "FLAME_EXPORT_HF_AT_END": "1"}  # fmt: skip
    command = ["python", "-m", "flame.train", "--job.dump_folder", str(dump), *TINY, "--checkpoint.enable"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Converted {dump / 'checkpoint' / 'step-4'} to {dump} (llama, float32)" in result.stdout
    assert json.loads((dump / "config.json").read_text())["model_type"] == "llama"
    assert (dump / "model.safetensors").is_file()
