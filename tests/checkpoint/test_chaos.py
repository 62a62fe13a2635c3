"""The short chaos test (scripts/chaos.py): on 2 CPU ranks (gloo, 2 dataloader workers each), one launch stopped
by SIGTERM and one SIGKILLed while writing a checkpoint; the finished job equals an uninterrupted run bit for bit
and the SIGTERM saved the step in progress (exit 75) and lost no step. With a time limit already spent no trial
starts, and the job runs uninterrupted a second time and equals the first."""

import json
import subprocess
import sys

import pytest

from tests.checkpoint.helpers import REPO

pytestmark = pytest.mark.slow


def chaos(tmp_path, *options: str) -> tuple[dict, str]:
    report = tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos.py"), "--seed", "0", "--workdir", str(tmp_path), "--json",
         str(report), *options],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(report.read_text())["summary"], result.stdout


def test_killed_and_preempted_launches_end_with_the_uninterrupted_weights(tmp_path):
    summary, out = chaos(tmp_path, "--trials", "2", "--scenarios", "sigterm,sigkill_save")
    assert summary["trials"] == 2 and summary["sigterm_saves"] == 1, summary
    assert summary["kills_during_save"] == 1, summary
    assert summary["mismatches"] == 0 and summary["steps_lost_after_sigterm"] == 0, summary
    assert "job chaos-1: its step-12 checkpoint equals the reference's bit for bit" in out
    assert not (tmp_path / "chaos-1" / "checkpoint").exists()  # checked, then deleted
    assert (tmp_path / "reference" / "checkpoint" / "step-12").is_dir()


def test_a_spent_time_limit_starts_no_trial_and_repeats_the_job(tmp_path):
    summary, out = chaos(tmp_path, "--trials", "5", "--time_limit", "0")
    assert summary["trials"] == 0 and summary["stopped_by_time_limit"], summary
    assert summary["jobs_finished"] == 1 and summary["mismatches"] == 0, summary
    assert "job chaos-1: its step-12 checkpoint equals the reference's bit for bit" in out
