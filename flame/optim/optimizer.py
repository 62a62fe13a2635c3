"""AdamW (or Adam) over two parameter groups: matrices decay, everything else does not.

Which parameters skip weight decay is flame.models.common.weight_decay's rule (every parameter below two
dimensions: norm scales, biases, A_log, dt_bias ...; plus the embeddings with ``--optimizer.no-decay-embeddings``,
as OLMo does). The hyperparameters are torchtitan's fields: optimizer.lr, beta1, beta2, eps, weight_decay and
implementation (fused, foreach or for-loop; fused runs on CUDA and, since torch 2.4, on the CPU).
"""

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from flame.models.common.weight_decay import no_weight_decay_names

OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = True) -> list[dict]:
    """[{params that decay, weight_decay}, {params that do not, weight_decay 0}], empty groups left out."""
    skip = no_weight_decay_names(model, exclude_embeddings=not decay_embeddings)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name in skip else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


class GroupedOptimizersContainer(OptimizersContainer):
    """torchtitan's container (checkpointing, one optimizer per model part) built from parameter groups."""

    def __init__(
        self, model_parts: list[nn.Module], optimizer_cls: type, kwargs: dict, decay_embeddings: bool
    ):
        self.model_parts = model_parts
        self.optimizers = []
        all_params = []
        for model in model_parts:
            groups = param_groups(model, kwargs["weight_decay"], decay_embeddings)
            self.optimizers.append(optimizer_cls(groups, **kwargs))
            all_params.extend(p for group in groups for p in group["params"])
        self._validate_length(len(model_parts))
        self._post_init(all_params, kwargs)


def build_optimizers(model_parts: list[nn.Module], job_config) -> OptimizersContainer:
    config = job_config.optimizer
    kwargs = {
        "lr": config.lr,
        "betas": (config.beta1, config.beta2),
        "eps": config.eps,
        "weight_decay": config.weight_decay,
        "fused": config.implementation == "fused",
        "foreach": config.implementation == "foreach",
    }
    optimizers = GroupedOptimizersContainer(
        model_parts, OPTIMIZERS[config.name], kwargs, config.decay_embeddings
    )
    groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    decayed = sum(p.numel() for g in groups if g["weight_decay"] > 0 for p in g["params"])
    skipped = sum(p.numel() for g in groups if g["weight_decay"] == 0 for p in g["params"])
    logger.info(
        f"Optimizer {config.name} ({config.implementation}): lr {config.lr:g}, betas ({config.beta1}, "
        f"{config.beta2}), eps {config.eps:g}, weight decay {config.weight_decay:g} on {decayed:,} parameters "
        f"(embeddings {'in' if config.decay_embeddings else 'out'}), none on {skipped:,}"
    )
    return optimizers
