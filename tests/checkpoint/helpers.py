"""Running flame's trainer on 2 CPU ranks for the checkpoint tests, and reading back what it logged."""

import os
import subprocess
import sys
from pathlib import Path

from tests.trainer_helpers import free_port

REPO = Path(__file__).resolve().parents[2]


def run(command: list[str], env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})}
    )


def train_sh(dump: Path, *args: str, ngpu: int = 2, export_hf: bool = True) -> subprocess.CompletedProcess:
    return run(
        ["bash", str(REPO / "train.sh"), "--job.dump_folder", str(dump), "--metrics.log_freq", "1", *args],
        env={
            "NGPU": str(ngpu),
            "FLAME_EXPORT_HF": "1" if export_hf else "0",
        },
    )


def killed_run(dump: Path, kill: str, *args: str, ngpu: int = 2, env_name: str = "FLAME_TEST_KILL", env=None):
    """flame.train under torchrun with FLAME_TEST_KILL=kill, or another of crash_run.py's variables (``env``: more)."""
    return run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ngpu), "--master_port", str(free_port()),
         "-m", "tests.checkpoint.crash_run", "--job.dump_folder", str(dump), "--metrics.log_freq", "1", *args],
        env={env_name: kill, "OMP_NUM_THREADS": "1", **(env or {})},
    )  # fmt: skip


def output(result: subprocess.CompletedProcess, dump: Path | None = None) -> str:
    """The end of a run's console output and, given its dump folder, of every rank's own log."""
    text = result.stdout[-3000:] + result.stderr[-3000:]
    for log in sorted((dump / "logs").rglob("stderr.log")) if dump else []:
        text += f"\n--- {log}\n" + log.read_text()[-3000:]
    return text
