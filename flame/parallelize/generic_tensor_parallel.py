"""Tensor parallelism for transformers' causal LMs on the generic path: the plan the config class declares
(``base_model_tp_plan``, keys ``layers.*.<module>``), applied to the blocks with torch's DTensor styles.

transformers' styles (transformers/integrations/tensor_parallel.py) map to torch's:

- ``colwise``: ColwiseParallel (weight and bias split over output features, the output left split: each rank
  holds its heads, which the attention's ``view(..., -1, head_dim)`` reads as its local head count);
- ``rowwise``: RowwiseParallel (weight split over input features, output summed over the ranks);
- ``colwise_gather_output`` / ``rowwise_split_input`` (OLMo2's attention): the same with the colwise output
  gathered whole on every rank and the rowwise input split again (each rank then attends with all heads);
- ``replicated_with_grad_allreduce`` (Qwen3's per-head q/k norms): the weight replicated, run on this rank's
  heads, its gradient summed over the ranks (:class:`ReplicatedOnShards`).

Every parameter the plan does not name (the blocks' norms, embeddings, final norm, lm_head) is replicated: every
rank computes it whole (:class:`ReplicatedOnShards` over replicated inputs). Sequence parallelism and loss
parallelism are not applied: the residual stream and the logits are whole on every rank.
"""

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from flame.errors import ConfigError
from flame.models.layers.sharding import local_tensor

logger = logging.getLogger(__name__)

BLOCK_PREFIX = "layers.*."  # transformers' plans name the block modules under the base model's layers


class ReplicatedOnShards(ParallelStyle):
    """A module whose own parameters are replicated over the TP mesh and whose tensor inputs are ``shard_dim``-split
    over it (None: whole on every rank); it returns plain tensors. With split inputs the replicated parameters'
    gradients are partial sums, which FSDP or ``reduce_partial_grads`` add up over the ranks."""

    def __init__(self, shard_dim: int | None = None):
        super().__init__()
        self.shard_dim = shard_dim

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param, mesh, [Replicate()])
                module.register_parameter(param_name, nn.Parameter(replicated, param.requires_grad))

    def _inputs(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        def placed(x):
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
                return x
            placement = Replicate() if self.shard_dim is None else Shard(self.shard_dim % x.ndim)
            return DTensor.from_local(x, mesh, [placement], run_check=False)

        return tuple(placed(x) for x in inputs)

    @staticmethod
    def _outputs(module: nn.Module, outputs, mesh: DeviceMesh):
        return local_tensor(outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)


def style_of(name: str) -> ParallelStyle | None:
    """torch's style for one of transformers' plan entries, None for one flame does not map."""
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    # OLMo2's q/k/v, whose q/k norms span all heads: every rank gets them all
    if name == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    # OLMo2's o_proj after the gathered attention: each rank takes its slice
    if name == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "replicated_with_grad_allreduce":
        return ReplicatedOnShards(shard_dim=-2)  # (batch, seq, heads, head_dim): split over the heads
    return None


def block_plan(config) -> dict[str, ParallelStyle]:
    """The class's declared plan for one block, keyed by module name inside the block; ConfigError (one line) for
    an entry outside the blocks or a style flame does not map."""
    declared = getattr(config, "base_model_tp_plan", None) or {}
    if not declared:
        raise ConfigError(
            f"{type(config).__name__} declares no tensor-parallel plan (base_model_tp_plan); use "
            "tensor_parallel_degree 1"
        )
    plan = {}
    for key, name in declared.items():
        style = style_of(name)
        if not key.startswith(BLOCK_PREFIX) or style is None:
            raise ConfigError(
                f"{type(config).__name__}'s tensor-parallel plan has {key}: {name}, which flame does not apply "
                "(it maps colwise, rowwise, their gather/split variants and replicated_with_grad_allreduce on the "
                "blocks); use tensor_parallel_degree 1"
            )
        plan[key.removeprefix(BLOCK_PREFIX)] = style
    return plan


def apply_generic_tp(model: nn.Module, tp_mesh: DeviceMesh, blocks: list[nn.Module]) -> None:
    """Tensor-parallelize a generic-path model in place (on the meta device, before FSDP): the declared plan on
    every block of ``blocks`` (the family's block stacks), every other parameter replicated (as transformers leaves
    what its plan does not name)."""
    plan = block_plan(model.config)
    for stack in blocks:
        for block in stack.children():
            parallelize_module(block, tp_mesh, plan)
    input_embeddings, output_embeddings = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output_embeddings is not None and output_embeddings.weight is input_embeddings.weight
    for module in model.modules():  # the blocks' norms, embeddings, final norm, lm_head
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, tp_mesh, ReplicatedOnShards())
    if tied:  # both were replicated on their own: one parameter again
        output_embeddings.weight = input_embeddings.weight
    logger.info(
        "Applied tensor parallelism (degree %d, %s's declared plan)", tp_mesh.size(), type(model).__name__
    )
