"""What a training step minimises, given a micro-batch's logits (or, for a model with
``fuse_linear_cross_entropy``, its final hidden states and lm_head, which computes the loss from them chunk by
chunk).

An objective returns the micro-batch's summed loss and summed metrics; the step divides both by the step's
``count`` over every rank (labelled tokens for language modelling, preference pairs for DPO), so that
accumulation and data parallelism give the gradient and the means of one big batch.
"""

import contextlib

import torch
from torchtitan.tools.logging import logger

from flame.config.checks import l2warp_factor
from flame.loss import (
    IGNORE_INDEX,
    dpo_losses,
    l2_warp,
    labelled_tokens,
    loss_sums,
    sequence_logprobs,
)
from flame.models.common.args import ModelArgs
from flame.parallelize.compile import maybe_compile_loss
from flame.train.model_parts import ModelParts, Topology, autocast_context, build_model_parts


class LanguageModelObjective:
    """Next-token cross-entropy over the labelled tokens, plus training.z_loss x logsumexp(logits)^2
    (job.task pretrain and sft: sft data labels the assistant's tokens only), with the L2-warp of ``l2warp``
    (flame.config.checks.l2warp_factor) on the gradients. ``fused``: the step passes the final hidden states instead of the logits, and
    lm_head computes the same sums from them without the logits (compile.components' loss does not apply: the
    fused loss is its matmuls, run eagerly)."""

    def __init__(self, job_config, fused: bool = False, l2warp: float = 0.0):
        self.z_loss = job_config.training.z_loss
        self.fused = fused
        self.l2warp = l2warp
        self.loss_fn = loss_sums if fused else maybe_compile_loss(loss_sums, job_config.compile)

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        return labelled_tokens(labels)

    def __call__(self, output, labels, inputs, lm_head=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.fused:
            loss, cross_entropy, z_term = lm_head(
                output, labels, ignore_index=IGNORE_INDEX, z_loss=self.z_loss, l2warp=self.l2warp
            )
        else:
            cross_entropy, z_term = self.loss_fn(output, labels, z_loss=self.z_loss > 0)
            loss = cross_entropy + self.z_loss * z_term
            if self.l2warp > 0:
                loss = l2_warp(loss, output, labels, self.l2warp)
        metrics = {"loss": cross_entropy}
        if self.z_loss > 0:
            metrics["z_loss"] = self.z_loss * z_term
        return loss, metrics


class DPOObjective:
    """Direct preference optimisation (job.task dpo): rows are the micro-batch's chosen replies, then its
    rejected ones (flame/data/packing.py's collate_pairs); the reference model is the frozen starting weights,
    run on the same rows without gradients. Its per-sequence log-probabilities need the logits
    (flame/parallelize/checks.py refuses fuse_linear_cross_entropy with DPO)."""

    fused = False

    def __init__(self, job_config, reference: ModelParts, amp: contextlib.AbstractContextManager):
        self.beta = job_config.dpo.beta
        self.kind = job_config.dpo.loss
        self.reference = reference
        self.amp = amp

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        # A fill on the device: torch.tensor(n, device=...) would copy from the host and wait for the device.
        return torch.full((), labels.shape[0] // 2, device=labels.device)  # pairs

    def __call__(self, logits, labels, inputs, lm_head=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad(), self.amp:
            reference_logits = self.reference.parts[0](
                inputs["input"], position_ids=inputs.get("position_ids"), cu_seqlens=inputs.get("cu_seqlens")
            )
            reference = sequence_logprobs(reference_logits, labels)
        del reference_logits
        losses, chosen, rejected = dpo_losses(
            sequence_logprobs(logits, labels), reference, self.beta, self.kind
        )
        return losses.sum(), {
            "loss": losses.detach().sum(),
            "dpo/rewards_chosen": chosen.sum(),
            "dpo/rewards_rejected": rejected.sum(),
            "dpo/reward_margin": (chosen - rejected).sum(),
            "dpo/accuracy": (chosen > rejected).float().sum(),
        }


def build_objective(
    model_args: ModelArgs, topology: Topology, job_config
) -> LanguageModelObjective | DPOObjective:
    """job.task's objective. DPO's reference model is built and sharded like the policy, frozen, in eval mode; it
    holds random weights until the caller copies the starting weights in (or loads them from a checkpoint)."""
    l2warp = l2warp_factor(model_args, job_config)
    if job_config.job.task != "dpo":
        return LanguageModelObjective(job_config, model_args.fuse_linear_cross_entropy, l2warp)
    if l2warp > 0:
        # As FLA's class, which applies it only to the loss it computes from labels.
        logger.info("DPO's loss is trained without the L2-warp (use_l2warp, training.enable_l2wrap)")
    reference = build_model_parts(model_args, topology, job_config)
    for part in reference.parts:
        part.eval()
        part.requires_grad_(False)
    return DPOObjective(job_config, reference, autocast_context(topology, job_config))
