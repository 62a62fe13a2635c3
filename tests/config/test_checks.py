"""Wrong values stop the run at start-up with one line (pre-flight and trainer share flame.config.checks)."""

import os
import subprocess
from pathlib import Path

import pytest

from flame.config import parse_args
from flame.config.checks import validate_job
from flame.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--optimizer.lr", "-0.001"], "optimizer.lr must be > 0, got -0.001"),
        (["--training.varlen", "--training.batch_size", "2"], "training.batch_size must be 1, got 2"),
        (["--optimizer.beta2", "1.0"], "optimizer.beta2 must be in [0, 1), got 1.0"),
        (["--optimizer.eps", "0"], "optimizer.eps must be > 0"),
        (["--optimizer.weight_decay", "-1"], "optimizer.weight_decay must be >= 0"),
        (["--optimizer.name", "SGD"], "optimizer.name must be AdamW, Adam or Muon, got 'SGD'"),
        (["--optimizer.name", "Muon", "--optimizer.muon_momentum", "1"], "optimizer.muon_momentum must be in [0, 1)"),
        (["--optimizer.muon_ns_iterations", "0"], "optimizer.muon_ns_iterations must be >= 1, got 0"),
        (["--optimizer.early_step_in_backward"], "optimizer.early_step_in_backward is not supported"),
        (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps must be >= 0"),
        (["--lr_scheduler.lr_min", "1.5"], "lr_scheduler.min_lr_factor (lr_min) is a fraction of the peak LR"),
        (["--lr_scheduler.decay_ratio", "0.95"], "lr_scheduler.warmup_steps (20) + decay steps (285"),
        (["--lr_scheduler.total_steps", "100"], "lr_scheduler.total_steps (100) must be >= training.steps (300)"),
        (["--metrics.log_freq", "0"], "metrics.log_freq must be >= 1, got 0"),
        (["--training.z_loss", "-1e-5"], "training.z_loss must be >= 0"),
        (["--training.max_norm", "0"], "training.max_norm must be a positive number"),
        (["--training.stop_at_step", "301"], "training.stop_at_step must be between 1 and training.steps (300)"),
        (["--training.gc_freq", "0"], "training.gc_freq must be >= 1"),
        (["--validation.enable", "--validation.freq", "0"], "validation.freq must be >= 1"),
        (["--validation.enable", "--validation.steps", "0"], "validation.steps must be >= 1, or -1"),
        (["--inference.interval", "-5"], "inference.interval must be >= 0"),
        (["--inference.interval", "5", "--inference.prompt", " | "], "inference.prompt is empty"),
        (["--inference.interval", "5", "--inference.top_k", "-1"], "inference.top_k must be >= 0"),
        (["--profiling.enable_profiling", "--profiling.profile_freq", "3"],
         "profiling.profile_freq (3) must be >= profiler_warmup + profiler_active (3 + 1)"),
        (["--parallelism.pipeline_parallel_degree", "2", "--training.z_loss", "1e-4"],
         "training.z_loss is not computed by the pipeline schedule's loss"),
        (["--parallelism.pipeline_parallel_degree", "2", "--validation.enable"],
         "validation runs the whole model on one rank"),
        (["--parallelism.pipeline_parallel_degree", "2", "--inference.interval", "5"],
         "text samples run the whole model on one rank"),
    ],
)  # fmt: skip
def test_wrong_values_are_one_line_errors(flags, message):
    with pytest.raises(ConfigError) as info:
        validate_job(parse_args(flags))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_the_default_job_and_the_seed_recipe_values_pass():
    validate_job(parse_args([]))
    validate_job(parse_args(["--training.steps", "100000", "--lr_scheduler.warmup_steps", "1000",
                             "--optimizer.eps", "1e-15", "--optimizer.lr", "3e-4", "--training.z_loss", "1e-5",
                             "--optimizer.scheduler", "wsd", "--training.stop_at_step", "5000"]))  # fmt: skip


def test_train_sh_refuses_a_wrong_value_before_starting_ranks(tmp_path):
    result = subprocess.run(
        ["bash", str(REPO / "train.sh"), "--optimizer.lr", "-1", "--job.dump_folder", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=os.environ,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == "error: optimizer.lr must be > 0, got -1.0"
    assert not (tmp_path / "run").exists()
