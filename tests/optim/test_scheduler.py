"""The LR schedule (torchtitan's warmup-stable-decay) as flame's flags set it, older flame's scheduler names."""

import math

import pytest
import torch

from flame.config import parse_args
from flame.errors import ConfigError
from flame.optim import build_lr_schedulers, build_optimizers, schedule_phases


def lrs(*flags: str) -> list[float]:
    """The LR of every step (1..training.steps) of a schedule with lr 1."""
    config = parse_args(["--optimizer.lr", "1", "--training.steps", "10", *flags])
    optimizers = build_optimizers([torch.nn.Linear(2, 2)], config)
    schedulers = build_lr_schedulers(optimizers, config)
    values = []
    for _ in range(config.training.steps):
        values.append(schedulers.schedulers[0].get_last_lr()[0])
        schedulers.step()
    return values


def test_warmup_then_cosine_to_lr_min():
    values = lrs("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "cosine",
                 "--lr_scheduler.lr_min", "0.1")  # fmt: skip
    assert values[:3] == [0.5, 1.0, 1.0]
    # Step s (0-indexed) >= 3: progress (s - 2) / 8 of the cosine from 1 down to 0.1.
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(3, 10)]
    assert values[3:] == pytest.approx(expected)
    assert min(values) > 0.1


def test_a_warmup_longer_than_the_schedule_is_cut_to_it_as_torchtitan_does():
    # Upstream flame's commands carry --lr_scheduler.warmup_steps 1000; a short trial lowers only training.steps.
    config = parse_args(["--training.steps", "10", "--lr_scheduler.warmup_steps", "1000"])
    assert schedule_phases(config) == (10, 0, 0)
    assert lrs("--lr_scheduler.warmup_steps", "1000") == pytest.approx([(s + 1) / 10 for s in range(10)])


def test_linear_decay_and_the_older_scheduler_name():
    values = lrs(
        "--lr_scheduler.warmup_steps", "0", "--optimizer.scheduler", "linear", "--lr_scheduler.lr_min", "0"
    )
    assert values == pytest.approx([1.0] + [1 - s / 10 for s in range(1, 10)])


def test_wsd_keeps_the_lr_until_the_last_decay_ratio_of_the_steps():
    values = lrs("--lr_scheduler.warmup_steps", "1", "--optimizer.scheduler", "wsd", "--lr_scheduler.decay_ratio",
                 "0.3", "--lr_scheduler.decay_type", "sqrt", "--lr_scheduler.lr_min", "0")  # fmt: skip
    # Decay over the last 3 steps; as in every schedule, its end (p = 1) falls one step after the last.
    assert values[:8] == [1.0] * 8
    assert values[8:] == pytest.approx([1 - math.sqrt(p / 3) for p in (1, 2)])
    phases = schedule_phases(parse_args(["--training.steps", "10", "--lr_scheduler.warmup_steps", "1",
                                         "--optimizer.scheduler", "wsd"]))  # fmt: skip
    assert phases == (1, 8, 1)  # wsd without decay_ratio decays over the last 10%


def test_older_flame_optimizer_flags_map_onto_torchtitans():
    config = parse_args(["--optimizer.scheduler", "cosine", "--optimizer.min_lr_ratio", "0.2",
                         "--training.warmup_steps", "7", "--optimizer.fused",
                         "--optimizer.implementation", "foreach"])  # fmt: skip
    assert config.lr_scheduler.decay_type == "cosine" and config.lr_scheduler.decay_ratio is None
    assert config.lr_scheduler.min_lr_factor == 0.2 and config.lr_scheduler.warmup_steps == 7
    assert config.optimizer.implementation == "fused"
    with pytest.raises(ConfigError, match="optimizer.scheduler cosine decays from the end of warmup"):
        parse_args(["--optimizer.scheduler", "cosine", "--lr_scheduler.decay_ratio", "0.2"])
    with pytest.raises(ConfigError, match="--optimizer.scheduler must be one of wsd, cosine, linear"):
        parse_args(["--optimizer.scheduler", "step"])
