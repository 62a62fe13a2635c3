"""fuse_linear_cross_entropy in the model config: the objective gets the final hidden states and lm_head computes the
loss chunk by chunk. Per family (tied transformer, Gated DeltaNet hybrid, DeltaNet) the loss and every parameter's
gradient equal the unfused objective's in float64 (rtol = atol = 1e-10: the same sums in another order), with and
without the L2-warp; the
Trainer validates alike and trains the same curves of loss, z-loss and gradient norm fused and unfused in float32 (rtol 1e-5), with
z-loss and ignored tokens."""

import json
from pathlib import Path

import pytest
import torch

from flame.config import parse_args
from flame.loss import IGNORE_INDEX
from flame.models.common.decoder import fuses_linear_cross_entropy
from flame.train.objective import LanguageModelObjective
from tests.models.helpers import tiny_model

ASSETS = Path(__file__).resolve().parents[2] / "flame" / "assets"


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("transformer", {"num_heads": 4, "tie_word_embeddings": True}),
        ("gated_deltanet", {"num_heads": 2, "head_dim": 16, "attn": {"layers": [1], "num_heads": 4}}),
        ("delta_net", {"num_heads": 2}),
    ],
)
@pytest.mark.parametrize("l2warp", [0.0, 1e-2])
def test_fused_objective_gives_the_unfused_loss_and_gradients(model_type, overrides, l2warp):
    model = tiny_model(model_type, torch.float64, vocab_size=61, fuse_linear_cross_entropy=True, **overrides)
    assert fuses_linear_cross_entropy(model)
    job_config = parse_args(["--training.z_loss", "1e-3"])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 61, (2, 19), generator=generator)
    labels = torch.randint(0, 61, (2, 19), generator=generator)
    labels[0, :5] = labels[1, 11:] = IGNORE_INDEX
    results = []
    for objective in (
        LanguageModelObjective(job_config, l2warp=l2warp),
        LanguageModelObjective(job_config, fused=True, l2warp=l2warp),
    ):
        model.zero_grad()
        output = model(tokens, return_hidden=objective.fused)
        loss, metrics = objective(output, labels, {"input": tokens}, model.lm_head)
        loss.backward()
        results.append((loss, metrics, {name: p.grad.clone() for name, p in model.named_parameters()}))
    (loss, metrics, grads), (fused_loss, fused_metrics, fused_grads) = results
    tight = {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(fused_loss, loss, **tight)
    for name in ("loss", "z_loss"):
        torch.testing.assert_close(fused_metrics[name], metrics[name].detach(), **tight)
    assert grads.keys() == fused_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, **tight, msg=lambda m, name=name: f"{name}: {m}")


def fused_config(tmp_path: Path, fuse: bool) -> str:
    config = json.loads((ASSETS / "tiny.json").read_text())
    config.update(num_hidden_layers=2, fuse_linear_cross_entropy=fuse)
    path = tmp_path / f"fused_{fuse}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_trainer_trains_the_same_loss_curve_fused(make_trainer, tmp_path):
    flags = ["--training.z_loss", "1e-2", "--training.steps", "3"]
    trainers = [
        make_trainer("--model.config", fused_config(tmp_path, fuse), *flags) for fuse in (False, True)
    ]
    assert [trainer.train_step_fn.objective.fused for trainer in trainers] == [False, True]
    data = iter(trainers[0].dataloader)
    batches = [next(data) for _ in range(3)]
    for _, labels in batches:
        labels[0, :20] = IGNORE_INDEX
    curves = []
    for trainer in trainers:
        curve = []
        for inputs, labels in batches:
            result = trainer.train_step_fn([(inputs, labels)])
            curve.append(
                [*(float(result.metrics[name]) for name in ("loss", "z_loss")), float(result.grad_norm)]
            )
        curves.append(torch.tensor(curve, dtype=torch.float64))
    assert curves[0][-1, 0] < curves[0][0, 0]  # it trains
    torch.testing.assert_close(curves[1], curves[0], rtol=1e-5, atol=0)  # loss, z-loss, gradient norm
