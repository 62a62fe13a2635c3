"""Optimization: AdamW with weight-decay groups, or Muon for the blocks' matrices (optimizer.py, muon.py), and the
warmup-stable-decay LR schedule (scheduler.py)."""

from flame.optim.optimizer import build_optimizers, param_groups
from flame.optim.scheduler import build_lr_schedulers, schedule_phases

__all__ = ["build_lr_schedulers", "build_optimizers", "param_groups", "schedule_phases"]
