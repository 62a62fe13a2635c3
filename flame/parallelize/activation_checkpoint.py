"""Activation checkpointing per block through torchtitan's ``apply_ac``: full, selective (every n-th block, or
per op) and memory_budget (the compiler's min-cut partitioner; needs compile)."""

import torch
from torch import nn
from torchtitan.distributed.activation_checkpoint import apply_ac

from flame.models import model_spec

# Per-op selective AC saves these ops' outputs (torchtitan llama3's list) and recomputes the rest. FLA's Triton
# ops are autograd Functions, which the policy does not see: they are recomputed.
OP_SAC_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def apply_activation_checkpointing(model: nn.Module, job_config) -> None:
    """Wrap each block (checks.check_activation_checkpoint validated the options). torchtitan's apply_ac wraps
    the children of a module's ``layers``: it gets a holder of each of the family's block stacks in turn."""
    for stack in model_spec(model.args).blocks(model):
        holder = nn.Module()
        holder.layers = stack
        apply_ac(
            holder,
            job_config.activation_checkpoint,
            model_compile_enabled=job_config.compile.enable,
            op_sac_save_list=OP_SAC_SAVE_LIST,
            base_folder=job_config.job.dump_folder,
        )
