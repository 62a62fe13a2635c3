"""Steps skipped for a non-finite gradient norm (``training.skip_nan_inf``): which parameters had NaN or Inf
gradients on the first step of a streak, and a stop after ``training.skip_nan_inf_limit`` consecutive skips (a run
whose every step is skipped learns nothing; it stops before saving another checkpoint).

Fused Adam and AdamW skip the update on the device (``skip_on_device``): the step never reads the gradient norm back,
and ``NonFiniteSteps`` reads a step's verdict once the next step's kernels are queued, so that the host never waits
for a step's backward before queuing the rest. Other optimizers (Muon, foreach or for-loop AdamW) need the verdict on
the host before they step: the training step reads it there (one wait per step)."""

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from flame.errors import FlameError
from flame.models.layers.sharding import local_tensor


class NonFiniteGradients(FlameError):
    """Too many consecutive steps had a non-finite gradient norm."""


def skips_on_device(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Every optimizer skips its update where its ``found_inf`` tensor is 1, on the device (torch's fused Adam and
    AdamW, which torch's GradScaler drives the same way)."""
    return all(
        isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and optimizer.defaults.get("fused")
        for optimizer in optimizers
    )


def skip_on_device(optimizers: list[torch.optim.Optimizer], nonfinite: torch.Tensor) -> None:
    """The optimizers' next step leaves parameters and state (step counts included) as they are where
    ``nonfinite`` (a device tensor) is true."""
    found_inf = nonfinite.float()
    for optimizer in optimizers:
        optimizer.found_inf = found_inf


@dataclasses.dataclass
class Verdict:
    step: int
    skipped: torch.Tensor | bool  # a device tensor until read
    grad_norm: torch.Tensor
    # This rank's norm of each gradient, in the order of the parameters that have one (from clip_grad_norm_).
    gradient_norms: torch.Tensor


def named_on_any_rank(verdict: Verdict, model_parts: list[torch.nn.Module]) -> list[str]:
    """Names of the parameters whose gradient held a NaN or Inf on any rank (the same list on every rank). Read
    when the verdict is settled, from the parameters that have a gradient then: the same ones, in the same order."""
    with_grads = [
        name for part in model_parts for name, param in part.named_parameters() if param.grad is not None
    ]
    norms = verdict.gradient_norms.tolist()
    names = [name for name, norm in zip(with_grads, norms, strict=True) if not math.isfinite(norm)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = [name for rank_names in gathered for name in rank_names]
    return sorted(set(names))


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[torch.nn.Parameter], max_norm: float, pp_mesh=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan's clip_grad_norm_ (2-norm, foreach, no expert parallelism), except that a non-finite norm leaves
        the gradients as they are: clipping by a NaN factor would make every gradient NaN and hide which parameters
        went bad (the step is skipped, or the optimizer spreads the NaN, either way). Returns the total norm and, from
        the same foreach norm, this rank's norm of each gradient (not finite where this rank's part of it holds a NaN or
    an Inf)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0), torch.zeros(0)
    norms = torch._foreach_norm(grads, 2.0)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
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
    local = torch.stack([local_tensor(norm) for norm in norms])
    return total, local


class NonFiniteSteps:
    """The verdicts of training.skip_nan_inf: ``record`` keeps a step's on the device and reads the one before
    (whose step has finished by then, or nearly); ``settle`` reads the last one now (before it is logged or saved).
    Every rank records and settles at the same steps (the naming gathers over ranks)."""

    def __init__(self, enabled: bool, limit: int, model_parts: list[torch.nn.Module]):
        self.enabled = enabled
        self.limit = limit
        self.model_parts = model_parts
        self.consecutive = 0
        self.skipped_steps = 0
        self.pending: Verdict | None = None

    def record(
        self, step: int, skipped: torch.Tensor | bool, grad_norm: torch.Tensor, gradient_norms: torch.Tensor
    ) -> None:
        if not self.enabled:
            return
        self.settle()
        self.pending = Verdict(step, skipped, grad_norm, gradient_norms)

    def settle(self) -> None:
        verdict, self.pending = self.pending, None
        if verdict is None:
            return
        if not bool(verdict.skipped):
            self.consecutive = 0
            return
        self.skipped_steps += 1
        self.consecutive += 1
        logger.warning(
            f"step {verdict.step}: gradient norm is {verdict.grad_norm.item()}; the update was skipped"
        )
        if self.consecutive == 1:
            names = named_on_any_rank(verdict, self.model_parts)
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            logger.warning(
                f"step {verdict.step}: non-finite gradients in {len(names)} parameter(s): {shown or 'none'}"
            )
        if self.limit and self.consecutive >= self.limit:
            raise NonFiniteGradients(
                f"{self.consecutive} consecutive steps (to step {verdict.step}) had a non-finite gradient norm and "
                f"were skipped (training.skip_nan_inf_limit {self.limit}); nothing after the last checkpoint was "
                "saved. Lower the learning rate or resume from an earlier checkpoint"
            )
