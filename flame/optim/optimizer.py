"""AdamW (or Adam) over two parameter groups, matrices decay and everything else does not; or Muon for the
blocks' weight matrices with AdamW for the rest.

Which parameters skip weight decay is flame.models.common.weight_decay's rule (every parameter below two
dimensions: norm scales, biases, A_log, dt_bias ...; plus the embeddings with ``--optimizer.no-decay-embeddings``,
as OLMo does). The hyperparameters are torchtitan's fields: optimizer.lr, beta1, beta2, eps, weight_decay and
implementation (fused, foreach or for-loop; fused runs on CUDA and, since torch 2.4, on the CPU).

``--optimizer.name Muon`` (flame.optim.muon) splits each model part's parameters in two, as OLMo-core and
torchtitan do: Muon takes the 2-D weights of the blocks (attention and linear-attention projections, MLPs), with
optimizer.lr, optimizer.weight_decay, optimizer.muon_momentum, muon_ns_iterations and muon_ns_dtype; AdamW takes
every other parameter (embeddings, lm_head, norm scales, biases, short-convolution kernels, A_log, dt_bias ...) with
the settings ``--optimizer.name AdamW`` would give it (the same lr, betas, eps, implementation and decay groups).
Muon's updates are scaled to AdamW's RMS, so one learning rate serves both. Both follow the same LR schedule.
"""

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from flame.models import model_spec
from flame.models.common.weight_decay import no_weight_decay_names
from flame.optim.muon import Muon

OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
OPTIMIZER_NAMES = (*OPTIMIZERS, "Muon")


def param_groups(
    model: nn.Module,
    weight_decay: float,
    decay_embeddings: bool = True,
    exclude: frozenset[int] = frozenset(),
) -> list[dict]:
    """[{params that decay, weight_decay}, {params that do not, weight_decay 0}], empty groups left out;
    parameters whose id is in ``exclude`` are left out too."""
    skip = no_weight_decay_names(model, exclude_embeddings=not decay_embeddings)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in exclude:
            (no_decay if name in skip else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable 2-D parameters of the family's blocks: the matrices Muon orthogonalises."""
    return [
        param
        for stack in model_spec(model.args).blocks(model)
        for param in stack.parameters()
        if param.requires_grad and param.ndim == 2
    ]


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


class MuonOptimizersContainer(OptimizersContainer):
    """Per model part a Muon over its blocks' matrices and an AdamW over the rest (either left out when it would
    have no parameters). ``optimizers`` lists them all, so the LR schedule, zero_grad and step reach each one;
    checkpoints hold each part's two optimizers' states, flattened per parameter name as torchtitan's are."""

    def __init__(
        self, model_parts: list[nn.Module], muon_kwargs: dict, adamw_kwargs: dict, decay_embeddings: bool
    ):
        self.model_parts = model_parts
        self.optimizers = []
        self.part_optimizers: list[list[torch.optim.Optimizer]] = []
        all_params = []
        for model in model_parts:
            matrices = muon_parameters(model)
            groups = param_groups(
                model, adamw_kwargs["weight_decay"], decay_embeddings, frozenset(map(id, matrices))
            )
            part = [Muon(matrices, **muon_kwargs)] if matrices else []
            if groups:
                part.append(torch.optim.AdamW(groups, **adamw_kwargs))
            self.part_optimizers.append(part)
            self.optimizers.extend(part)
            all_params.extend(matrices)
            all_params.extend(p for group in groups for p in group["params"])
        self._post_init(all_params, {"lr": adamw_kwargs["lr"]})

    def state_dict(self) -> dict:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return {
            key: value
            for model, part in zip(self.model_parts, self.part_optimizers)
            for key, value in get_optimizer_state_dict(model, part, options=options).items()
        }

    def load_state_dict(self, state_dict: dict) -> None:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for model, part in zip(self.model_parts, self.part_optimizers):
            set_optimizer_state_dict(model, part, state_dict, options=options)


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
    if config.name == "Muon":
        muon_kwargs = {
            "lr": config.lr,
            "momentum": config.muon_momentum,
            "weight_decay": config.weight_decay,
            "ns_steps": config.muon_ns_iterations,
            "ns_dtype": config.muon_ns_dtype,
        }
        optimizers = MuonOptimizersContainer(model_parts, muon_kwargs, kwargs, config.decay_embeddings)
    else:
        optimizers = GroupedOptimizersContainer(
            model_parts, OPTIMIZERS[config.name], kwargs, config.decay_embeddings
        )
    groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    decayed = sum(p.numel() for g in groups if g["weight_decay"] > 0 for p in g["params"])
    skipped = sum(p.numel() for g in groups if g["weight_decay"] == 0 for p in g["params"])
    muon = ""
    if config.name == "Muon":
        matrices = sum(
            p.numel() for o in optimizers if isinstance(o, Muon) for g in o.param_groups for p in g["params"]
        )
        muon = (
            f"; Muon (momentum {config.muon_momentum}, {config.muon_ns_iterations} Newton-Schulz steps in "
            f"{config.muon_ns_dtype}) on the blocks' {matrices:,} matrix parameters, AdamW on the rest"
        )
    logger.info(
        f"Optimizer {config.name} ({config.implementation}): lr {config.lr:g}, betas ({config.beta1}, "
        f"{config.beta2}), eps {config.eps:g}, weight decay {config.weight_decay:g} on {decayed:,} parameters "
        f"(embeddings {'in' if config.decay_embeddings else 'out'}), none on {skipped:,}{muon}"
    )
    return optimizers
