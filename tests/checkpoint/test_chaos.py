"""The short chaos test (scripts/chaos.py): on 2 CPU ranks (gloo, 2 dataloader workers each), one launch stopped
by SIGTERM and one SIGKILLed while writing a checkpoint; the finished job equals an uninterrupted run bit for bit
and the SIGTERM saved the step in progress (exit 75) and lost no step. The time limit and the repeat check, with
the launches replaced."""

import importlib.util
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
    assert "job chaos-1: its step-12 checkpoint equals the reference's bit for bit" in result.stdout
    assert not (tmp_path / "chaos-1" / "checkpoint").exists()  # checked, then deleted
    assert (tmp_path / "reference" / "checkpoint" / "step-12").is_dir()


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", REPO / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replace_launches(monkeypatch, chaos_script) -> tuple[list[str], list[str]]:
    """The script's launches and trials replaced: each launch leaves a last checkpoint and succeeds, each trial is
    a SIGKILL. Returns the launched dump folders' names and the trials' scenarios, as they happen."""
    launched, trials = [], []

    class Launch:
        def __init__(self, dump, ngpu, flags):
            self.dump, self.log_path = dump, dump.parent / "launch.log"
            (dump / "checkpoint" / "step-12").mkdir(parents=True, exist_ok=True)
            launched.append(dump.name)

        def wait(self):
            return 0

    def run_trial(dump, scenario, *args):
        trials.append(scenario)
        return {"scenario": scenario, "signalled": True, "status": -9, "during_save": False, "during_purge": False,
                "problems": []}  # fmt: skip

    monkeypatch.setattr(chaos_script, "Launch", Launch)
    monkeypatch.setattr(chaos_script, "run_trial", run_trial)
    monkeypatch.setattr(chaos_script, "run_steps_done", lambda dump: -1)
    return launched, trials


@pytest.mark.parametrize(("time_limit", "trials_run"), [("0", 0), ("3600", 3)])
def test_the_time_limit_stops_the_trials_and_the_job_is_still_checked(
    tmp_path, monkeypatch, time_limit, trials_run
):
    """The loop of scripts/chaos.py with its launches replaced: no trial starts once the time limit has passed, and
    the job in progress is finished and checked either way."""
    chaos_script = load_chaos()
    _, trials = replace_launches(monkeypatch, chaos_script)
    finished = []
    monkeypatch.setattr(chaos_script, "finish", lambda dump, *args: finished.append(dump.name) or [])
    report = tmp_path / "chaos.json"
    argv = ["--trials", "3", "--time_limit", time_limit, "--workdir", str(tmp_path), "--json", str(report)]
    assert chaos_script.main(argv) == 0
    summary = json.loads(report.read_text())["summary"]
    assert len(trials) == summary["trials"] == trials_run
    assert summary["stopped_by_time_limit"] == (trials_run == 0)
    assert finished == ["chaos-1"] and summary["jobs_finished"] == 1


@pytest.mark.parametrize("repeats", [True, False])
def test_check_repeat_runs_the_job_twice_and_stops_if_the_runs_differ(tmp_path, monkeypatch, repeats):
    """--check_repeat with the launches replaced: a second uninterrupted run that differs from the first stops the
    script (exit 3) before any trial; one that equals it is deleted and the trials go on."""
    chaos_script = load_chaos()
    launched, trials = replace_launches(monkeypatch, chaos_script)
    compared = []

    def mismatches(reference, final):
        compared.append((reference.parent.parent.name, final.parent.parent.name))
        return ["embeddings.weight differs"] if final.parent.parent.name == "repeat" and not repeats else []

    monkeypatch.setattr(chaos_script, "mismatches", mismatches)
    status = chaos_script.main(["--trials", "2", "--check_repeat", "--workdir", str(tmp_path)])
    assert (status, len(trials)) == ((0, 2) if repeats else (3, 0))
    assert launched == (["reference", "repeat", "chaos-1"] if repeats else ["reference", "repeat"])
    assert compared[0] == ("reference", "repeat")
    assert (tmp_path / "repeat" / "checkpoint").exists() != repeats  # kept for a look only when it differs
