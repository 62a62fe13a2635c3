"""Evaluation during training (flame/train/evaluator.py): eval/<task>/<metric> every eval.interval steps equal to
what python -m flame.eval gives on the checkpoint of that step; bad eval options stop the launch in one line."""

import importlib.util
import json
import sys

import pytest

from flame import eval as eval_cli
from flame import launch
from flame.config import parse_args
from flame.config.checks import validate_job
from flame.errors import ConfigError, FlameError
from tests.trainer_helpers import tensorboard_scalars

pytest.importorskip("lm_eval", reason='the eval extra: pip install -e ".[eval]"')
TASK = "flame_corpus_last_word"
EVAL = ["--eval.tasks", TASK, "--eval.limit", "3", "--eval.batch_size", "4"]


def test_scores_at_each_interval_equal_flame_eval_on_that_steps_checkpoint(make_trainer, tmp_path, caplog):
    dump = tmp_path / "run"
    trainer = make_trainer("--training.steps", "3", "--eval.interval", "2", *EVAL,
                           "--checkpoint.enable", "--checkpoint.interval", "2", dump=dump)  # fmt: skip
    with caplog.at_level("INFO"):
        trainer.train()
    # Every interval and the last step; the export is deleted, the results stay.
    perplexity = tensorboard_scalars(dump, f"eval/{TASK}/perplexity")
    accuracy = tensorboard_scalars(dump, f"eval/{TASK}/acc")
    assert sorted(perplexity) == sorted(accuracy) == [2, 3]
    assert not (dump / "eval" / "step-2" / "hf").exists()
    assert "eval at step 2 " in caplog.text

    logged = json.loads((dump / "eval" / "step-2" / "results.json").read_text())["results"][TASK]
    # python -m flame.eval runs in a process of its own, without the trainer's preemption handler (which lm-eval's
    # forked bootstrap workers would inherit, ignoring the pool's SIGTERM): give the signals back first.
    trainer.preemption.close()
    argv = [str(dump), "--step", "2", "--tasks", TASK, "--limit", "3", "--batch_size", "4"]
    assert eval_cli.main([*argv, "--output", str(tmp_path / "cli")]) == 0
    offline = json.loads((tmp_path / "cli" / "results.json").read_text())["results"][TASK]
    # The same float32 weights through the same code on the CPU: equal up to float64 rounding.
    assert logged["acc,none"] == offline["acc,none"]
    assert logged["perplexity,none"] == pytest.approx(offline["perplexity,none"], rel=1e-12)
    assert perplexity[2] == pytest.approx(offline["perplexity,none"], rel=1e-7)  # TensorBoard keeps float32
    assert accuracy[2] == offline["acc,none"]
    assert perplexity[3] != pytest.approx(perplexity[2], rel=1e-4)  # step 3's weights, not step 2's


def test_an_unknown_task_stops_the_launch_in_one_line(tmp_path, monkeypatch, capsys):
    dump = tmp_path / "run"
    argv = ["--job.dump_folder", str(dump), "--eval.interval", "5", "--eval.tasks", f"{TASK},no_such_task"]
    monkeypatch.setattr(sys, "argv", ["flame.launch", *argv])
    assert launch.main() == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown lm-eval task no_such_task: ")
    assert "eval.include_path" in lines[0]
    assert not dump.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval.interval", "5"], "eval.interval is set but eval.tasks names no task"),
        (["--eval.interval", "-1", "--eval.tasks", TASK], "eval.interval must be >= 0"),
        (["--eval.interval", "5", "--eval.tasks", TASK, "--eval.limit", "2.5"], "eval.limit is a number"),
        (["--eval.interval", "5", "--eval.tasks", TASK, "--eval.batch_size", "0"], "eval.batch_size must be >= 1"),
        (["--eval.interval", "5", "--eval.tasks", TASK, "--eval.include_path", "/nope"],
         "eval.include_path /nope is not a folder of task YAMLs"),
    ],
)  # fmt: skip
def test_bad_eval_options_are_refused(flags, message):
    with pytest.raises(FlameError, match=message):
        validate_job(parse_args(flags))


def test_without_lm_eval_the_launch_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r'needs lm-evaluation-harness, which is not installed: pip install -e "\.\[eval\]"'
    ):
        validate_job(parse_args(["--eval.interval", "5", "--eval.tasks", TASK]))
    validate_job(parse_args(["--eval.tasks", TASK]))  # eval.interval 0: evaluation is off, lm-eval not needed


def test_scores_are_named_by_task_metric_and_filter():
    from flame.train.evaluator import eval_metrics

    results = {
        "results": {
            "gsm8k": {
                "alias": "gsm8k",
                "exact_match,strict-match": 0.25,
                "exact_match_stderr,strict-match": 0.5,
            },
            TASK: {"acc,none": 1, "perplexity_stderr,none": "N/A", "sample_len": 3},
        }
    }
    assert eval_metrics(results) == {
        "eval/gsm8k/exact_match/strict-match": 0.25,
        "eval/gsm8k/exact_match_stderr/strict-match": 0.5,
        f"eval/{TASK}/acc": 1.0,
    }
