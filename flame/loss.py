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


def labelled_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many positions have a target."""
    return (labels != IGNORE_INDEX).sum()


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
