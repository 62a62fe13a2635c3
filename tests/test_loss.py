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


@pytest.mark.parametrize("ignored", [0, 7])
def test_l2_warp_gives_flas_gradients_for_a_batch_whose_loss_is_a_mean(ignored):
    """One micro-batch of 3 x 11 positions, vocabulary 13, float64: FLA's mean cross-entropy with its l2_warp
    (fla/modules/l2warp.py) and flame's summed loss with l2_warp, divided by the labelled tokens as the step does,
    have the same gradient (rtol = atol = 1e-12), with and without ignored labels."""
    fla_l2warp = pytest.importorskip("fla.modules.l2warp")
    from flame.loss import l2_warp

    generator = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(3, 11, 13, generator=generator, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 13, (3, 11), generator=generator)
    labels.view(-1)[torch.randperm(33, generator=generator)[:ignored]] = IGNORE_INDEX
    mean = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
    )
    (expected,) = torch.autograd.grad(fla_l2warp.l2_warp(mean, logits), logits)
    cross_entropy, _ = loss_sums(logits, labels, z_loss=False)
    loss = l2_warp(cross_entropy, logits, labels, 1e-4)
    assert loss.item() == cross_entropy.item()  # the loss itself is unchanged
    (grad,) = torch.autograd.grad(loss / labelled_tokens(labels), logits, retain_graph=True)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    (plain,) = torch.autograd.grad(cross_entropy / labelled_tokens(labels), logits)
    top = logits.detach().argmax(-1, keepdim=True)
    pull = (grad - plain).gather(-1, top)
    torch.testing.assert_close(pull, 1e-4 * logits.detach().gather(-1, top) / 33, rtol=1e-9, atol=0)
    assert torch.count_nonzero(grad - plain) == 33  # the largest logit of each position only


def test_l2warp_is_on_with_the_config_key_or_upstreams_flag():
    """FLA's use_l2warp (RWKV7's config has it on by default) or upstream flame's --training.enable_l2wrap, at
    --training.l2wrap_factor or FLA's 1e-4."""
    from flame.config import parse_args
    from flame.config.checks import l2warp_factor
    from flame.models import model_args_from_dict

    shapes = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1}
    transformer, _ = model_args_from_dict({"model_type": "transformer", "num_heads": 2, **shapes})
    warped, _ = model_args_from_dict(
        {"model_type": "transformer", "num_heads": 2, "use_l2warp": True, **shapes}
    )
    rwkv7, _ = model_args_from_dict({"model_type": "rwkv7", "head_dim": 16, **shapes})
    llama, _ = model_args_from_dict({"model_type": "llama", "num_attention_heads": 2, **shapes})
    plain, flag = parse_args([]), parse_args(["--training.enable_l2wrap", "--training.l2wrap_factor", "3e-4"])
    assert [l2warp_factor(args, plain) for args in (transformer, warped, rwkv7, llama)] == [
        0.0,
        1e-4,
        1e-4,
        0.0,
    ]
    assert [l2warp_factor(args, flag) for args in (transformer, llama)] == [3e-4, 3e-4]
