"""flame/loss.py: the summed cross-entropy and z-loss every path divides by the same token counts."""

import torch

from flame.loss import IGNORE_INDEX, TokenNormalizedLoss, labelled_tokens, loss_sums


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
