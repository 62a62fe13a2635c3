"""The short chaos test (scripts/chaos.py): on 2 CPU ranks (gloo, 2 dataloader workers each), one launch stopped
by SIGTERM and one SIGKILLed while writing a checkpoint; the finished job equals an uninterrupted run bit for bit
and the SIGTERM saved the step in progress (exit 75) and lost no step."""

import json
import subprocess
import sys

import pytest

from tests.checkpoint.helpers import REPO

pytestmark = pytest.mark.slow


def test_killed_and_preempted_launches_end_with_the_uninterrupted_weights(tmp_path):
    report = tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos.py"), "--trials", "2", "--scenarios", "sigterm,sigkill_save",
         "--seed", "0", "--workdir", str(tmp_path), "--json", str(report)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(report.read_text())["summary"]
    assert summary["trials"] == 2 and summary["sigterm_saves"] == 1, summary
    assert summary["kills_during_save"] == 1, summary
    assert summary["mismatches"] == 0 and summary["steps_lost_after_sigterm"] == 0, summary
