"""flame's one language-model loss: cross-entropy summed over the labelled tokens (labels are already shifted:
``labels[t]`` is the token after ``input[t]``; ``IGNORE_INDEX`` marks positions with no target), plus the z-loss
term. The trainer, validation, the pipeline schedule, the bench and the HF classes all call these, so every path
divides the same sums by the same token counts."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def loss_sums(logits: torch.Tensor, labels: torch.Tensor, z_loss: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the labelled tokens, and the z-loss term logsumexp(logits)^2 summed over the same
    tokens (zero unless ``z_loss``)."""
    # float32 at least (bf16 logits lose the small probabilities); float64 logits stay float64.
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    labels = labels.flatten()
    cross_entropy = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if not z_loss:
        return cross_entropy, torch.zeros_like(cross_entropy)
    return cross_entropy, (logits.logsumexp(-1).square() * (labels != IGNORE_INDEX)).sum()


def labelled_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many positions have a target."""
    return (labels != ignore_index).sum()


def l2_warp_pull(labels: torch.Tensor, factor: float, dtype: torch.dtype, ignore_index: int = IGNORE_INDEX):
    """``l2_warp``'s gradient per unit of a position's largest logit, per unit of the summed loss's gradient:
    ``factor`` x the labelled share of the positions. FLA divides by the positions of a batch whose loss is a
    mean over its labelled tokens: the same ratio of the pull to the cross-entropy's per-token gradient."""
    return factor * labelled_tokens(labels, ignore_index).to(dtype) / labels.numel()


class _L2Warp(torch.autograd.Function):
    """The loss unchanged; its backward adds ``factor`` x the largest logit x the loss's gradient to the gradient of
    each position's largest logit (the logits' own L2 pull towards 0 at their maximum)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, logits: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        top, index = logits.detach().max(-1, keepdim=True)
        ctx.save_for_backward(top * factor, index)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        pull, index = ctx.saved_tensors
        grad_logits = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad_loss.device)
        grad_logits.scatter_(-1, index, (pull * grad_loss).to(ctx.dtype))
        return grad_loss, grad_logits, None


def l2_warp(loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, factor: float) -> torch.Tensor:
    """RWKV's L2Wrap as FLA's ``use_l2warp`` applies it (fla/modules/l2warp.py): the summed loss ``loss`` of
    ``logits`` unchanged, and in backward every position's largest logit gets a gradient of its value x
    ``l2_warp_pull``."""
    pull = l2_warp_pull(labels, factor, torch.promote_types(logits.dtype, torch.float32))
    return _L2Warp.apply(loss, logits, pull)


class TokenNormalizedLoss:
    """Summed cross-entropy of a micro-batch / ``global_tokens`` (set by the training step before the pipeline
    schedule runs): the sum over micro-batches and ranks is the step's mean loss, as without pipelining."""

    def __init__(self):
        self.global_tokens: torch.Tensor | float | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.global_tokens is None:
            raise RuntimeError("set TokenNormalizedLoss.global_tokens before running the pipeline schedule")
        cross_entropy, _ = loss_sums(logits, labels, z_loss=False)
        return cross_entropy / self.global_tokens


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its labelled tokens, and how many there are."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    token_logprobs = -F.cross_entropy(
        logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    return token_logprobs.sum(-1), (labels != IGNORE_INDEX).sum(-1)


def dpo_losses(
    policy: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    beta: float,
    kind: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the DPO loss, the chosen reply's reward and the rejected one's.

    ``policy`` and ``reference`` are (log-probabilities, labelled-token counts) of 2N rows, the N chosen replies
    then the N rejected ones. sigmoid: -log sigmoid(beta x ((chosen - rejected) - (ref chosen - ref rejected)))
    (Rafailov et al. 2023, "Direct Preference Optimization"); ipo: the same difference of log-ratios over
    per-token log-probabilities, loss (difference - 1 / (2 beta))^2 (Azar et al. 2023, "A General Theoretical
    Paradigm to Understand Learning from Human Preferences"). Rewards are beta x (policy - reference) log-prob of
    a reply, summed over its tokens."""
    (logprobs, counts), (ref_logprobs, _) = policy, reference
    rewards = (beta * (logprobs - ref_logprobs)).detach().chunk(2)
    if kind == "ipo":
        logprobs, ref_logprobs = logprobs / counts, ref_logprobs / counts
    chosen, rejected = logprobs.chunk(2)
    ref_chosen, ref_rejected = ref_logprobs.chunk(2)
    difference = (chosen - rejected) - (ref_chosen - ref_rejected)
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * difference)
    elif kind == "ipo":
        losses = (difference - 1 / (2 * beta)).square()
    else:
        raise ValueError(f"DPO loss must be sigmoid or ipo, got {kind!r}")
    return losses, rewards[0], rewards[1]
