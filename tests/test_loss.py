"""flame/loss.py: the summed cross-entropy and z-loss every path divides by the same token counts, and DPO."""

import math

import pytest
import torch

from flame.loss import (
    IGNORE_INDEX,
    TokenNormalizedLoss,
    dpo_losses,
    labelled_tokens,
    loss_sums,
    sequence_logprobs,
)


def test_loss_sums_z_term_is_logsumexp_squared_over_labelled_tokens():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[1, 3:] = IGNORE_INDEX
    cross_entropy, z = loss_sums(logits, labels, z_loss=True)
    mask = labels != IGNORE_INDEX
    lse = logits.logsumexp(-1)
    expected_ce = (lse - logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0])[mask].sum()
    torch.testing.assert_close(cross_entropy, expected_ce)
    torch.testing.assert_close(z, lse[mask].square().sum())
    assert loss_sums(logits, labels, z_loss=False)[1] == 0


def test_token_normalized_loss_sums_to_the_mean_over_micro_batches():
    """The pipeline's loss: each micro-batch's summed cross-entropy over the step's labelled tokens, so the parts
    add up to the mean over every labelled token of the step, however many each micro-batch holds."""
    logits = torch.randn(4, 6, 9, dtype=torch.float64)
    labels = torch.randint(0, 9, (4, 6))
    labels[0, 1:] = IGNORE_INDEX
    labels[2, :2] = IGNORE_INDEX
    loss = TokenNormalizedLoss()
    loss.global_tokens = labelled_tokens(labels)
    total = loss(logits[:1], labels[:1]) + loss(logits[1:], labels[1:])
    mask = labels != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[mask], labels[mask])
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=0)


def test_sequence_logprobs_sum_each_rows_labelled_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 5))
    labels[1, :4] = IGNORE_INDEX
    logprobs, counts = sequence_logprobs(logits, labels)
    for row in range(3):
        expected = sum(
            torch.log_softmax(logits[row, t], -1)[labels[row, t]].item()
            for t in range(5)
            if labels[row, t] != IGNORE_INDEX
        )
        assert logprobs[row].item() == pytest.approx(expected, rel=1e-12)
    assert counts.tolist() == [5, 1, 5]


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_losses_and_rewards_follow_the_papers_formulas(kind):
    """Two pairs of fixed log-probabilities: the loss and rewards written out per pair in float64."""
    beta = 0.25
    policy = torch.tensor([-3.0, -7.5, -4.0, -6.0], dtype=torch.float64)  # chosen 0, 1 then rejected 0, 1
    reference = torch.tensor([-3.5, -7.0, -3.0, -6.5], dtype=torch.float64)
    counts = torch.tensor([2, 5, 4, 3])
    losses, chosen, rejected = dpo_losses((policy, counts), (reference, counts), beta, kind)
    for i in range(2):
        pc, pr, rc, rr = policy[i].item(), policy[i + 2].item(), reference[i].item(), reference[i + 2].item()
        if kind == "sigmoid":
            margin = (pc - pr) - (rc - rr)
            expected = -math.log(1 / (1 + math.exp(-beta * margin)))
        else:
            nc, nr = counts[i].item(), counts[i + 2].item()
            margin = (pc / nc - pr / nr) - (rc / nc - rr / nr)
            expected = (margin - 1 / (2 * beta)) ** 2
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)
        assert chosen[i].item() == pytest.approx(beta * (pc - rc), rel=1e-12)
        assert rejected[i].item() == pytest.approx(beta * (pr - rr), rel=1e-12)


def test_dpo_loss_is_log_2_where_the_policy_is_the_reference():
    logprobs = (torch.tensor([-2.0, -9.0, -4.0, -1.0], dtype=torch.float64), torch.tensor([1, 2, 3, 4]))
    losses, chosen, rejected = dpo_losses(logprobs, logprobs, beta=0.1)
    torch.testing.assert_close(losses, torch.full((2,), math.log(2), dtype=torch.float64))
    assert chosen.abs().max() == rejected.abs().max() == 0
