"""The training step, top to bottom. The Trainer, the throughput bench and the parallel test harness run this
same step.

1. Split each micro-batch over the context-parallel group (each rank keeps a slice of every row).
2. Count what the objective averages over (labelled tokens, or preference pairs) in the whole step over every
   data-parallel and cp rank: each micro-batch's summed loss is divided by that count, so accumulation and
   sharding give the gradient of one big batch.
3. Forward + backward of each micro-batch with the objective (flame/train/objective.py; through the pipeline
   schedule when there are stages), plus the model's auxiliary loss where it has one (a generic-path
   mixture-of-experts class's load balancing). A model with fuse_linear_cross_entropy returns its final hidden states, and
   the objective computes the loss from them through lm_head without the logits. A kernel that fails to build in
   a compiled block or a backward pass takes its backend out, and one process starts these passes over without it.
4. Clip the gradient norm (the norm before clipping is what the step reports).
5. Step the optimizer, unless the norm is not finite and training.skip_nan_inf says to skip (fused Adam and AdamW
   skip on the device, without reading the norm back: flame/optim/nonfinite.py); step the schedule.

Steps 3, 4 and 5 are profiler regions (``STEP_REGIONS``): a profile tells how long the host takes to issue each.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import record_function
from torchtitan.tools.logging import logger

from flame.config.checks import l2warp_factor
from flame.errors import KernelBuildError
from flame.models.common.decoder import fuses_linear_cross_entropy
from flame.ops import dispatch
from flame.ops.context_parallel import sequence_sharded
from flame.optim import build_lr_schedulers, build_optimizers
from flame.optim.nonfinite import clip_grad_norm_, skip_on_device, skips_on_device
from flame.parallelize.checks import uses_cuda_graphs
from flame.parallelize.compile import graph_break_report
from flame.parallelize.context_parallel import ROW_CU_SEQLENS, shard_batch
from flame.train.model_parts import ModelParts, Topology, autocast_context
from flame.train.objective import LanguageModelObjective

# The step's phases as torch.profiler sees them (the throughput bench reports each one's host time).
STEP_REGIONS = ("flame.forward_backward", "flame.clip_grad_norm", "flame.optimizer")

Batch = tuple[
    dict[str, torch.Tensor], torch.Tensor
]  # ({"input": ..., "position_ids"?, "cu_seqlens"?}, labels)


@dataclass
class StepResult:
    # This rank's shares of the step's means: "loss" (cross-entropy, or the DPO loss; 0 off the last pipeline
    # stage) and the objective's other metrics.
    metrics: dict[str, torch.Tensor]
    local_share: (
        torch.Tensor
    )  # this rank's part of what the step averages over (its tokens / all ranks' tokens)
    grad_norm: torch.Tensor  # before clipping
    gradient_norms: (
        torch.Tensor
    )  # this rank's norm of each gradient (flame/optim/nonfinite.py names the bad ones)
    tokens: int  # tokens this device trained on
    # The update was skipped (non-finite gradient norm): a device tensor where the optimizers skipped it on the
    # device (reading it waits for the step's backward).
    skipped: torch.Tensor | bool


class TrainStep:
    """``step(batches)`` trains one optimizer step on ``batches`` (this data-parallel rank's micro-batches)."""

    def __init__(
        self,
        model: ModelParts,
        optimizers,
        lr_schedulers,
        topology: Topology,
        job_config,
        amp: contextlib.AbstractContextManager,
        before_update: Callable[[], None] | None = None,
        objective=None,
    ):
        self.model = model
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.topology = topology
        self.amp = amp
        self.max_norm = job_config.training.max_norm
        self.skip_nan_inf = job_config.training.skip_nan_inf
        self.objective = objective or LanguageModelObjective(
            job_config,
            fused=fuses_linear_cross_entropy(model.parts[0]),
            l2warp=l2warp_factor(model.parts[0].args, job_config),
        )
        self.before_update = before_update  # e.g. wait for an async checkpoint to finish copying the weights
        self.marks_cuda_graph_steps = uses_cuda_graphs(job_config.compile)
        # torch.compile's graph breaks, named after the first step (which traces the compiled regions)
        self.reports_graph_breaks = job_config.compile.enable
        self.skips_on_device = skips_on_device(optimizers.optimizers)

    def __call__(self, batches: list[Batch]) -> StepResult:
        topology = self.topology
        # The blocks' CUDA graphs may reuse the last step's output memory from here.
        if self.marks_cuda_graph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        self.optimizers.zero_grad()
        if topology.cp_group is not None:
            batches = [shard_batch(inputs, labels, topology.cp_group) for inputs, labels in batches]
        batches = [on_device(inputs, labels, topology.device) for inputs, labels in batches]
        local_count = sum(self.objective.count(labels) for _, labels in batches).float()
        # A device tensor, never read on the host: .item() here (torchtitan's dist_sum), or a count made on the
        # host and copied over, would make every step wait for the last one's kernels before launching its own.
        global_count = (
            funcol.all_reduce(local_count, "sum", group=topology.loss_mesh)
            if topology.loss_mesh is not None
            else local_count
        )
        with record_function(STEP_REGIONS[0]):
            shares = self.forward_backward_all(batches, global_count)
        dispatch.log_passed_over_calls()  # what compiled blocks' op calls passed over, once
        if self.reports_graph_breaks:
            self.reports_graph_breaks = False
            if report := graph_break_report():
                logger.warning(report)

        with record_function(STEP_REGIONS[1]):
            grad_norm, gradient_norms = clip_grad_norm_(
                self.model.parameters(), self.max_norm, pp_mesh=topology.pp_mesh
            )
        skipped = False
        if self.skip_nan_inf:
            nonfinite = ~grad_norm.isfinite()
            if self.skips_on_device:
                skip_on_device(self.optimizers.optimizers, nonfinite)
                skipped = nonfinite
            else:
                skipped = bool(nonfinite)  # the host decides: waits for this step's backward
        with record_function(STEP_REGIONS[2]):
            if skipped is not True:
                if self.before_update is not None:
                    self.before_update()
                self.optimizers.step()
            if self.lr_schedulers is not None:
                self.lr_schedulers.step()
        return StepResult(
            metrics={name: sum(share[name] for share in shares) for name in shares[0]},
            local_share=local_count / global_count,
            grad_norm=grad_norm,
            gradient_norms=gradient_norms,
            tokens=sum(labels.numel() for _, labels in batches),
            skipped=skipped,
        )

    def forward_backward_all(self, batches: list[Batch], global_count: torch.Tensor) -> list[dict]:
        """Forward + backward of every micro-batch. A kernel that fails to build where the dispatch table cannot move
        the call on by itself (inside a compiled region, or in a backward pass) takes its backend out
        (flame.ops.dispatch.take_out_failed_backends); one process then starts the step's passes over, the compiled
        regions traced again without that backend. Several ranks cannot start over in step (the others wait in
        collectives of the failed pass), so there the error ends the run and names the backend to turn off."""
        while True:
            try:
                return [self.forward_backward(inputs, labels, global_count) for inputs, labels in batches]
            except Exception as error:
                taken_out = dispatch.take_out_failed_backends(error)
                if not taken_out:
                    raise
                ranks = self.topology.parallel_dims.world_size
                if ranks > 1:
                    why = "; ".join(dispatch.why_out(op, backend) for op, backend in taken_out)
                    pairs = ",".join(f"{op}:{backend}" for op, backend in taken_out)
                    raise KernelBuildError(
                        f"{why}; {ranks} ranks cannot start the step over without it: run again with "
                        f"{dispatch.BACKENDS_OFF_VARIABLE}={pairs}"
                    ) from error
                torch._dynamo.reset()  # compiled regions chose the failed backend while tracing: trace them again
                self.optimizers.zero_grad()

    def forward_backward(
        self, input_dict: dict, labels: torch.Tensor, global_count: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Forward + backward of one micro-batch (on the device); returns its shares of the step's mean loss and
        metrics."""
        row_cu_seqlens = input_dict.get(ROW_CU_SEQLENS)
        inputs = {k: v for k, v in input_dict.items() if k != ROW_CU_SEQLENS}
        if self.model.schedule is not None:
            return self._forward_backward_pipelined(inputs, labels, global_count, row_cu_seqlens)
        # The backward exchanges between cp ranks too; loss parallel's backward needs its context as well.
        with (
            sequence_sharded(self.topology.cp_group, row_cu_seqlens),
            loss_parallel() if self.model.loss_parallel else contextlib.nullcontext(),
        ):
            model = self.model.parts[0]
            # A fused objective takes the final hidden states and applies lm_head itself.
            fused = {"return_hidden": True} if self.objective.fused else {}
            with self.amp:
                output = model(
                    inputs["input"],
                    position_ids=inputs.get("position_ids"),
                    cu_seqlens=inputs.get("cu_seqlens"),
                    **fused,
                )
                loss, metrics = self.objective(output, labels, inputs, model.lm_head if fused else None)
                # A generic-path model's own extra loss term (mixture-of-experts load balancing), a mean over the
                # micro-batch: weighted by the micro-batch's share of the step, as its cross-entropy is.
                auxiliary = getattr(model, "auxiliary_loss", None)
                if auxiliary is not None:
                    count = self.objective.count(labels)
                    loss = loss + auxiliary * count
                    metrics["aux_loss"] = auxiliary.detach() * count
            del output  # free before backward
            (loss / global_count).backward()
        return {name: value.detach() / global_count for name, value in metrics.items()}

    def _forward_backward_pipelined(
        self,
        inputs: dict,
        labels: torch.Tensor,
        global_count: torch.Tensor,
        row_cu_seqlens: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """The pipeline schedule runs forward + backward of the micro-batch in pieces over the stages; its loss
        divides by the step's labelled tokens already. Only the last stage has the loss (zero elsewhere); language
        modelling only, without z-loss (parallelize/checks.py refuses the rest).

        With context parallelism the rows are already this rank's slices (every pipeline micro-batch is a set of
        rows, so each is sliced too); the position ids go to every stage, and the cp exchanges run inside the
        schedule, in the same order on all ranks of a cp group (they hold the same stages)."""
        model = self.model
        model.pipeline_loss.global_tokens = global_count
        losses = [] if model.has_last_stage else None
        args = (inputs["input"],) if model.has_first_stage else ()
        kwargs = {k: inputs[k] for k in ("position_ids", "cu_seqlens") if k in inputs}
        with self.amp, sequence_sharded(self.topology.cp_group, row_cu_seqlens):
            model.schedule.step(
                *args, target=labels if model.has_last_stage else None, losses=losses, **kwargs
            )
        zero = torch.zeros((), device=self.topology.device)
        return {"loss": torch.stack(losses).sum().detach() if model.has_last_stage else zero}

    def global_metrics(self, result: StepResult) -> dict[str, float]:
        """The step's mean loss and metrics over every rank (a collective: every rank calls it)."""
        names = sorted(result.metrics)
        totals = torch.stack([_full(result.metrics[name]).float() for name in names]).to(self.topology.device)
        if self.topology.loss_mesh is not None:
            torch.distributed.all_reduce(totals, group=self.topology.loss_mesh.get_group())
        if self.model.schedule is not None:  # only the last stage has the loss
            torch.distributed.all_reduce(totals, group=self.topology.pp_mesh.get_group())
        return dict(zip(names, totals.tolist()))


def on_device(inputs: dict, labels: torch.Tensor, device: torch.device) -> Batch:
    """A micro-batch on ``device`` (already there: unchanged). Copies from the host do not wait for the device's
    queued work (from the loader's pinned memory they run in the background). A packed row's whole boundaries
    (context parallelism) stay on the host: the exchanges read them in Python, and a device copy would cost a sync
    every micro-batch."""
    moved = {k: v if k == ROW_CU_SEQLENS else v.to(device, non_blocking=True) for k, v in inputs.items()}
    return moved, labels.to(device, non_blocking=True)


def _full(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor: loss parallel leaves the loss a replicated DTensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def build_train_step(
    model: ModelParts,
    topology: Topology,
    job_config,
    before_update: Callable[[], None] | None = None,
    objective=None,
) -> TrainStep:
    """The step of ``job_config`` for ``model``: flame's optimizer and LR schedule over every model part, the
    autocast rule, float8's post-step hook where the model was converted, and the objective (default: language
    modelling)."""
    optimizers = build_optimizers(model.parts, job_config)
    lr_schedulers = build_lr_schedulers(optimizers, job_config)
    if (converter := getattr(model.parts[0], "float8_converter", None)) is not None:
        # Float8 all-gather with FSDP: precompute the next step's weight scales after each optimizer step.
        optimizers.register_step_post_hook(lambda *args, **kwargs: converter.post_optimizer_hook(model.parts))
    amp = autocast_context(topology, job_config)
    return TrainStep(model, optimizers, lr_schedulers, topology, job_config, amp, before_update, objective)
