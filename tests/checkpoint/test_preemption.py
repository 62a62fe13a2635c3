"""Preemption: a signal finishes the step, saves it and exits 75; a second signal or the timeout exits 76 unsaved.

The launcher side (train.sh forwarding SIGTERM to its ranks, exit status 75, exact resume on 2 ranks) is run by
the chaos test (tests/checkpoint/test_chaos.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from flame.checkpoint.layout import list_steps
from flame.checkpoint.preemption import EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED, Preempted, parse_signals
from flame.errors import ConfigError
from tests.checkpoint.helpers import REPO, killed_run, output

FLAGS = ["--checkpoint.enable", "--checkpoint.interval", "100", "--training.steps", "6"]


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()}


def test_a_signal_saves_the_step_in_progress_and_the_run_resumes_exactly(make_trainer, tmp_path):
    uninterrupted = make_trainer(*FLAGS, dump=tmp_path / "uninterrupted")
    uninterrupted.train()
    expected = weights(uninterrupted)

    dump = tmp_path / "run"
    trainer = make_trainer(*FLAGS, "--checkpoint.preempt_signals", "SIGUSR1", dump=dump)
    step = trainer.train_step

    def signalled_step(data_iterator):  # the signal arrives in the middle of step 3
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        step(data_iterator)

    trainer.train_step = signalled_step
    with pytest.raises(Preempted) as preempted:
        trainer.train()
    assert (preempted.value.step, preempted.value.exit_status) == (3, EXIT_PREEMPTED)
    assert list_steps(dump / "checkpoint") == {3: True}
    assert json.loads((dump / "preempted.json").read_text()) == {"step": 3, "signal": "SIGUSR1"}
    trainer.close()

    resumed = make_trainer(*FLAGS, dump=dump)
    assert not (dump / "preempted.json").exists()  # a new launch clears the record
    resumed.train()
    got = weights(resumed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """... and a preempted run leaves train.sh's end-of-run export (FLAME_EXPORT_HF_AT_END) undone."""
    dump = tmp_path / "run"
    result = killed_run(dump, "1:3", "--training.steps", "6", "--training.seq_len", "64", "--training.batch_size",
                        "2", "--lr_scheduler.warmup_steps", "1", "--checkpoint.interval", "100",
                        env_name="FLAME_TEST_SIGNAL", env={"FLAME_EXPORT_HF_AT_END": "1"})  # fmt: skip
    assert result.returncode != 0  # both ranks exit 75; torchrun reports a failure of its own
    assert json.loads((dump / "preempted.json").read_text()) == {"step": 3, "signal": "SIGUSR1"}, output(
        result, dump
    )
    assert list_steps(dump / "checkpoint") == {3: True}
    assert "Preempted by SIGUSR1 after step 3" in output(result, dump)
    assert not (dump / "config.json").exists()


@pytest.mark.slow
def test_train_sh_exits_76_when_the_ranks_stop_without_the_save(tmp_path):
    """The timeout (here shorter than any save) ends the ranks unsaved: train.sh says so last and exits 76."""
    dump = tmp_path / "run"
    process = subprocess.Popen(
        ["bash", "train.sh", "--job.dump_folder", str(dump), "--training.steps", "2000", "--training.seq_len", "64",
         "--training.batch_size", "2", "--checkpoint.interval", "2000", "--checkpoint.preempt_timeout", "0.001", "--metrics.log_freq", "1"],
        cwd=REPO, env={**os.environ, "NGPU": "1", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for line in process.stdout:  # the console shows rank 0's log as it is written
        if re.search(r"step +2/2000 ", line):
            break
    else:
        raise AssertionError(f"the run ended before step 2: {process.wait()}")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == EXIT_PREEMPTED_UNSAVED
    assert stderr.strip().splitlines()[-1].startswith("Stopped by SIGTERM before a checkpoint was saved")
    assert not (dump / "preempted.json").exists() and not (dump / "flame.lock").exists()


def run_handler(script: str, timeout: float, dump) -> subprocess.CompletedProcess:
    """A process with flame's handler for SIGUSR1 (on the CPU, no process group) running ``script``."""
    code = textwrap.dedent("""
        import os, signal, sys, time, torch
        from flame.checkpoint.preemption import Preemption
        preemption = Preemption(["SIGUSR1"], float(sys.argv[1]), sys.argv[2])
        def send():
            os.kill(os.getpid(), signal.SIGUSR1)
    """) + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code, str(timeout), str(dump)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_a_second_signal_exits_without_saving(tmp_path):
    result = run_handler(
        """
        send(); send()  # one signal delivered twice (launcher and scheduler): still one request
        time.sleep(0.2)
        assert preemption.requested()
        time.sleep(2.2)
        send()
        time.sleep(5)
    """,
        0,
        tmp_path,
    )
    assert result.returncode == EXIT_PREEMPTED_UNSAVED, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "[flame] a second SIGUSR1 after the preemption signal: exiting without saving"
    )


def test_the_timeout_exits_without_saving(tmp_path):
    result = run_handler(
        """
        send()
        time.sleep(20)
    """,
        0.5,
        tmp_path,
    )
    assert result.returncode == EXIT_PREEMPTED_UNSAVED
    assert "0.5 s passed after the preemption signal: exiting without saving" in result.stderr


def test_signal_names():
    assert parse_signals(["SIGTERM", "usr1"]) == [signal.SIGTERM, signal.SIGUSR1]
    assert parse_signals([""]) == []
    with pytest.raises(ConfigError, match="'SIGKILL' is not a signal a process can catch"):
        parse_signals(["SIGKILL"])
    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal"):
        parse_signals(["SIGNOPE"])
