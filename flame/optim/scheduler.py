"""The learning-rate schedule: torchtitan's linear warmup, optional stable phase, then decay.

Per step (0-indexed s, total T = lr_scheduler.total_steps or training.steps, W = warmup_steps):

- warmup: lr x (s + 1) / W for s < W;
- stable: lr until the last D = round(decay_ratio x T) steps (WSD); without decay_ratio, D = T - W (no stable phase);
- decay: lr x (m + (1 - m) x f(p)), p = (s + 1 - (T + 1 - D)) / D, m = min_lr_factor (flame's lr_min) and
  f = 1 - p (linear), 1 - sqrt(p) (sqrt) or (1 + cos(pi p)) / 2 (cosine). p = 1 falls one step after the last
  (torchtitan's "virtual last step"), so the last step's LR is still slightly above m x lr.

Older flame's ``--optimizer.scheduler {cosine,linear,wsd}`` maps onto these fields (flame.config.manager).
"""

import copy

from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.lr_scheduler import build_lr_schedulers as build_torchtitan_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from flame.config.checks import schedule_steps


class LRSchedulers(LRSchedulersContainer):
    """torchtitan's container, whose checkpoint is the first scheduler's state, loaded into every scheduler. With
    Muon a model part has two optimizers with different numbers of parameter groups, so the saved per-group lists
    are resized to each scheduler's groups; every group of every optimizer starts from optimizer.lr, so their
    entries are equal."""

    def __init__(self, built: LRSchedulersContainer):
        self.schedulers = built.schedulers

    def load_state_dict(self, state_dict: dict) -> None:
        for scheduler in self.schedulers:
            state = copy.deepcopy(state_dict)
            groups = len(scheduler.optimizer.param_groups)
            for key in ("base_lrs", "_last_lr", "lr_lambdas"):
                state[key] = state[key][:1] * groups
            scheduler.load_state_dict(state)


def schedule_phases(job_config) -> tuple[int, int, int]:
    """(warmup, stable, decay) steps of the schedule. A warmup longer than the schedule is cut to it, as torchtitan's
    builder does (upstream flame's commands keep their warmup when a short trial run lowers training.steps)."""
    config, total = job_config.lr_scheduler, schedule_steps(job_config)
    warmup = min(config.warmup_steps, total)
    decay = total - warmup if config.decay_ratio is None else round(total * config.decay_ratio)
    return warmup, total - warmup - decay, decay


def build_lr_schedulers(optimizers: OptimizersContainer, job_config) -> LRSchedulersContainer:
    config = job_config.lr_scheduler
    warmup, stable, decay = schedule_phases(job_config)
    cut = (
        f" (lr_scheduler.warmup_steps {config.warmup_steps} cut to the schedule)"
        if warmup < config.warmup_steps
        else ""
    )
    logger.info(
        f"LR schedule: {warmup} warmup steps{cut}, {stable} stable, {decay} {config.decay_type} decay to "
        f"{config.min_lr_factor:g} x lr"
    )
    return LRSchedulers(build_torchtitan_lr_schedulers(optimizers, config, schedule_steps(job_config)))
