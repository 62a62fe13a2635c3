"""job.task sft and dpo through the Trainer: the SFT loss covers the assistant's tokens only; DPO starts at log 2
against a frozen reference of the starting weights, and resumes exactly with that reference."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flame.loss import IGNORE_INDEX
from tests.train.test_step import captured_metrics, run_step
from tests.trainer_helpers import tensorboard_scalars

ASSETS = "flame/assets"
CHAT = ["--training.chat_template", f"{ASSETS}/chat_template.jinja"]
SFT = ["--job.task", "sft", "--training.dataset", f"{ASSETS}/chat", *CHAT]
DPO = ["--job.task", "dpo", "--training.dataset", f"{ASSETS}/preference", "--training.seq_len", "40", *CHAT]


def test_sft_loss_is_the_mean_cross_entropy_over_the_assistant_tokens(make_trainer):
    trainer = make_trainer(*SFT)
    inputs, labels = next(iter(trainer.dataloader))
    model = trainer.model_parts[0]
    with torch.no_grad():
        logits = model(inputs["input"])
    # By hand: the mean of -log p(target) over the positions whose target is an assistant token.
    log_probs = logits.double().log_softmax(-1)
    terms = [
        -log_probs[b, t, labels[b, t]].item()
        for b in range(labels.shape[0])
        for t in range(labels.shape[1])
        if labels[b, t] != IGNORE_INDEX
    ]
    assert 0 < len(terms) < labels.numel() // 2  # the questions and the template are not targets
    logged = captured_metrics(trainer)
    run_step(trainer, [(inputs, labels)])
    assert logged[0]["loss/train"] == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_dpo_starts_at_log_2_with_zero_rewards_and_keeps_its_reference_frozen(make_trainer):
    trainer = make_trainer(*DPO, "--optimizer.lr", "1e-2", "--training.steps", "3")
    trainer.train()  # copies the starting weights into the reference, then trains
    reference = {k: v.clone() for k, v in trainer.reference.parts[0].state_dict().items()}
    dump = Path(trainer.job_config.job.dump_folder)
    losses, margins = tensorboard_scalars(dump, "loss/train"), tensorboard_scalars(dump, "dpo/reward_margin")
    assert losses[1] == pytest.approx(math.log(2), abs=1e-6)
    assert margins[1] == pytest.approx(0, abs=1e-6)
    assert margins[3] != 0
    for name, value in trainer.reference.parts[0].state_dict().items():
        assert torch.equal(value, reference[name]), name
    policy = trainer.model_parts[0].state_dict()
    assert any(
        not torch.equal(policy[k], reference[k]) for k in reference
    )  # the policy moved, not the reference
    assert all(not p.requires_grad for p in trainer.reference.parts[0].parameters())


def test_dpo_resumes_exactly_against_its_original_reference(make_trainer, tmp_path):
    flags = [*DPO, "--optimizer.lr", "1e-2", "--training.steps", "4", "--checkpoint.enable",
             "--checkpoint.interval", "2"]  # fmt: skip
    make_trainer(*flags, dump=tmp_path / "whole").train()
    make_trainer(*flags, "--training.stop_at_step", "2", dump=tmp_path / "resumed").train()
    resumed = make_trainer(*flags, dump=tmp_path / "resumed")
    resumed.train()
    assert resumed.step == 4
    for tag in ("loss/train", "dpo/reward_margin", "grad_norm"):
        whole, parts = (
            tensorboard_scalars(tmp_path / "whole", tag),
            tensorboard_scalars(tmp_path / "resumed", tag),
        )
        assert parts == whole, tag


def test_dpo_refuses_pipeline_and_context_parallelism(make_trainer):
    from flame.errors import FlameError

    for flag in ("--parallelism.pipeline_parallel_degree", "--parallelism.context_parallel_degree"):
        with pytest.raises(FlameError, match="job.task dpo scores whole sequences on one rank"):
            make_trainer(*DPO, flag, "2")


def test_dpo_objective_counts_pairs_and_scores_rows_against_the_reference(make_trainer):
    """The step's DPO loss on one batch equals the loss written out from the two models' logits."""
    trainer = make_trainer(*DPO, "--training.batch_size", "3")
    trainer.reference.parts[0].load_state_dict(trainer.model_parts[0].state_dict())
    with torch.no_grad():  # a reference that differs from the policy
        for p in trainer.reference.parts[0].parameters():
            p.add_(0.01 * torch.randn_like(p))
    inputs, labels = next(iter(trainer.dataloader))
    with torch.no_grad():
        scores = []
        for model in (trainer.model_parts[0], trainer.reference.parts[0]):
            logp = -F.cross_entropy(
                model(inputs["input"]).double().flatten(0, 1), labels.flatten(), reduction="none"
            ).view(labels.shape)
            scores.append(logp.sum(-1))
    (pc, pr), (rc, rr) = scores[0].chunk(2), scores[1].chunk(2)
    beta = trainer.job_config.dpo.beta
    expected = -F.logsigmoid(beta * ((pc - pr) - (rc - rr))).mean().item()
    logged = captured_metrics(trainer)
    run_step(trainer, [(inputs, labels)])
    assert logged[0]["loss/train"] == pytest.approx(expected, rel=1e-5)
    assert logged[0]["dpo/accuracy"] == pytest.approx(((pc - rc) > (pr - rr)).double().mean().item())
