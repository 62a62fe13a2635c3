"""Steps skipped for a non-finite gradient norm (``training.skip_nan_inf``): which parameters had NaN or Inf
gradients on the first step of a streak, and a stop after ``training.skip_nan_inf_limit`` consecutive skips (a run
whose every step is skipped learns nothing; it stops before saving another checkpoint)."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from flame.errors import FlameError


class NonFiniteGradients(FlameError):
    """Too many consecutive steps had a non-finite gradient norm."""


def nonfinite_parameters(model_parts: list[torch.nn.Module]) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or Inf on any rank (the same list on every rank)."""
    names = []
    for part in model_parts:
        for name, param in part.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if not torch.isfinite(local).all():
                names.append(name)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = [name for rank_names in gathered for name in rank_names]
    return sorted(set(names))


@torch.no_grad()
def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float, pp_mesh=None) -> torch.Tensor:
    """torchtitan's clip_grad_norm_ (2-norm, foreach, no expert parallelism), except that a non-finite norm leaves
    the gradients as they are: clipping by a NaN factor would make every gradient NaN and hide which parameters
    went bad (the step is skipped, or the optimizer spreads the NaN, either way)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
    if isinstance(total, DTensor):  # the norm of this rank's shards: the full norm over every rank
        total = total.full_tensor()
    if pp_mesh is not None:  # each pipeline stage holds some of the parameters
        total **= 2.0
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total **= 0.5
    # A zero norm gives a clipping factor of 1: the gradients stay as they are.
    torch.nn.utils.clip_grads_with_norm_(
        parameters, max_norm, torch.where(total.isfinite(), total, 0.0), True
    )
    return total


class NonFiniteSteps:
    def __init__(self, limit: int):
        self.limit = limit
        self.consecutive = 0

    def finite(self) -> None:
        self.consecutive = 0

    def skipped(self, step: int, model_parts: list[torch.nn.Module]) -> None:
        self.consecutive += 1
        if self.consecutive == 1:
            names = nonfinite_parameters(model_parts)
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            logger.warning(
                f"step {step}: non-finite gradients in {len(names)} parameter(s): {shown or 'none'}"
            )
        if self.limit and self.consecutive >= self.limit:
            raise NonFiniteGradients(
                f"{self.consecutive} consecutive steps (to step {step}) had a non-finite gradient norm and were "
                f"skipped (training.skip_nan_inf_limit {self.limit}); nothing after the last checkpoint was saved. "
                "Lower the learning rate or resume from an earlier checkpoint"
            )
