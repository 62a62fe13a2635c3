"""Tensor parallelism (Megatron-style, DTensor APIs) for every flame block: heads split across the TP ranks.

Per block, with ``sp`` = sequence parallel (on by default, as in torchtitan's llama3):

- ``attn_norm`` / ``mlp_norm``: replicated weights; with sp each rank normalises its sequence chunk.
- the mixer's input is made one replicated DTensor (all-gathered over the sequence with sp), so the colwise
  projections below share one backward reduction instead of one per projection;
- every mixer's input projections are colwise (output features = heads, split in contiguous blocks) and
  ``o_proj`` is rowwise (reduce, or reduce-scatter over the sequence with sp);
- ``mlp``: gate/up colwise, down rowwise.

Mixer-specific parameters that are not in a linear layer are distributed by :class:`LocalParams` and read in the
mixers through ``flame.models.layers.sharding.local_param``:

- Attention: q/k/v colwise (GQA: query and key/value heads are split alike, so each rank keeps whole groups);
  QK-norm (per head_dim) replicated, run on the local heads; the scaled variants' per-head query scale Shard(0).
- GatedDeltaNet: q/k/v/a/b/g colwise; A_log and dt_bias (per value head) Shard(0); the depthwise short convs
  Shard(0) over channels, which lines up with the colwise q/k/v outputs; the gated output norm (per head_dim)
  replicated.
- DeltaNet: q/k/v/b/g colwise, short convs Shard(0), output norm replicated.

Mixers reshape with ``view(batch, seq, -1, head_dim)``, so they see their local head count. The model's ends:
embeddings vocab-parallel (rowwise, output replicated or sequence-sharded), final norm as the block norms,
lm_head colwise over the vocabulary with the logits gathered, or left vocab-sharded for loss parallel
(``loss_parallel=True``: the loss must then be computed under ``torch.distributed.tensor.parallel.loss_parallel()``).
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torchtitan.tools.logging import logger

from flame.errors import ConfigError
from flame.models.layers.attention import Attention
from flame.models.layers.delta_net import DeltaNet
from flame.models.layers.gated_deltanet import GatedDeltaNet
from flame.models.layers.mlp import GatedMLP


class LocalParams(ParallelStyle):
    """Distribute a module's own parameters (not its children's) over the TP mesh; the module keeps computing on
    local tensors, reading its parameters with ``local_param``. ``placements`` maps parameter names to their
    placement (default: replicated). ``sharded_input``: the module sees only this rank's heads or sequence chunk,
    so gradients of replicated parameters are partial sums (see flame.models.layers.sharding)."""

    def __init__(self, placements: dict[str, Placement] | None = None, sharded_input: bool = False):
        super().__init__()
        self.placements = placements or {}
        self.sharded_input = sharded_input

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            placement = self.placements.get(name, Replicate())
            module.register_parameter(
                name,
                nn.Parameter(distribute_tensor(param, device_mesh, [placement]), param.requires_grad),
            )
        module.tp_sharded_input = self.sharded_input
        return module


def mixer_plan(mixer: nn.Module, residual: Placement) -> tuple[dict[str, ParallelStyle], LocalParams | None]:
    """(plan of the mixer's children, style for the mixer's own parameters) for one sequence mixer."""
    out = {"o_proj": RowwiseParallel(output_layouts=residual)}
    per_head = LocalParams(sharded_input=True)  # replicated per-head_dim norm on local heads
    channels = LocalParams({"weight": Shard(0)})  # depthwise conv: one kernel per channel
    if isinstance(mixer, Attention):
        plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(), **out}
        if mixer.q_norm is not None:
            plan.update(q_norm=per_head, k_norm=per_head)
        own = LocalParams({"q_scale": Shard(0)}) if mixer.scaled else None
        return plan, own
    if isinstance(mixer, GatedDeltaNet):
        plan = {name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj")}
        if mixer.use_gate:
            plan["g_proj"] = ColwiseParallel()
        if mixer.use_short_conv:
            plan.update(q_conv1d=channels, k_conv1d=channels, v_conv1d=channels)
        plan.update(o_norm=per_head, **out)
        return plan, LocalParams({"A_log": Shard(0), "dt_bias": Shard(0)})
    if isinstance(mixer, DeltaNet):
        plan = {name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
        if mixer.use_beta:
            plan["b_proj"] = ColwiseParallel()
        if mixer.use_gate:
            plan["g_proj"] = ColwiseParallel()
        if mixer.use_short_conv:
            plan.update(q_conv1d=channels, k_conv1d=channels, v_conv1d=channels)
        plan.update(o_norm=per_head, **out)
        return plan, None
    raise ConfigError(
        f"tensor parallelism has no plan for the mixer {type(mixer).__name__}; use tensor_parallel_degree 1"
    )


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> None:
    """Tensor-parallelize a flame DecoderLM in place (on the meta device, before FSDP). Float8Linear layers
    (flame.parallelize.float8) take the regular styles: the all-gathers then run in bf16, as torchtitan does for
    its rowwise float8 recipes."""
    residual = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream between blocks
    norm = LocalParams(sharded_input=sequence_parallel)
    ends = {  # a pipeline stage may lack some of them
        "embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "norm": norm,
        "lm_head": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    ends = {name: style for name, style in ends.items() if getattr(model, name) is not None}
    tied = len(ends) == 3 and model.lm_head.weight is model.embeddings.weight
    parallelize_module(model, tp_mesh, ends)
    if tied:  # both sides are Shard(0) over the vocabulary: one parameter again
        model.lm_head.weight = model.embeddings.weight

    for block in model.layers.values():
        mixer = block.attn
        plan, own = mixer_plan(mixer, residual)
        if not isinstance(block.mlp, GatedMLP):
            raise ConfigError(f"tensor parallelism has no plan for {type(block.mlp).__name__}")
        block_plan = {
            "attn_norm": norm,
            # (hidden_states, position_ids, cu_seqlens): gather the hidden states once for all projections.
            "attn": PrepareModuleInput(
                input_layouts=(residual, None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=False,
            ),
            **{f"attn.{name}": style for name, style in plan.items()},
            "mlp_norm": norm,
            "mlp": PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=residual),
        }
        parallelize_module(block, tp_mesh, block_plan)
        if own is not None:
            parallelize_module(mixer, tp_mesh, own)
    logger.info(
        "Applied tensor parallelism (degree %d%s%s)",
        tp_mesh.size(),
        ", sequence parallel" if sequence_parallel else "",
        ", loss parallel" if loss_parallel else "",
    )


def reduce_partial_grads(model: nn.Module) -> None:
    """Without FSDP (which redistributes gradients to the parameters' placements itself), turn the partial-sum
    gradients of replicated parameters fed by sharded inputs into replicated ones as soon as they are final.

    The hooks are installed at the first forward: ``model.to_empty()`` swaps the parameters' contents, hooks
    included, so hooks registered on the meta parameters would be lost."""

    def reduce(param: torch.Tensor) -> None:
        if param.grad is not None and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(placements=param.placements)

    def install(module: nn.Module, args) -> None:
        for param in module.parameters():
            if isinstance(param, DTensor):
                param.register_post_accumulate_grad_hook(reduce)
        handle.remove()

    handle = model.register_forward_pre_hook(install)
