"""AdamW with weight-decay groups: which parameters decay, the hyperparameters, fused on the CPU, state round trip."""

import pytest
import torch

from flame.config import parse_args
from flame.models.common.weight_decay import no_weight_decay_names
from flame.optim import build_optimizers, param_groups
from tests.models.helpers import tiny_model


def grouped_names(model, optimizer) -> list[tuple[float, set[str]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in optimizer.param_groups]


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_groups_follow_the_no_weight_decay_rule(decay_embeddings):
    model = tiny_model("gated_deltanet", head_dim=8, num_heads=2, attn={"layers": [1], "num_heads": 4})
    flags = [] if decay_embeddings else ["--optimizer.no-decay-embeddings"]
    config = parse_args(["--optimizer.weight_decay", "0.05", *flags])
    (optimizer,) = build_optimizers([model], config)
    skip = no_weight_decay_names(model, exclude_embeddings=not decay_embeddings)
    all_names = {n for n, _ in model.named_parameters()}
    assert grouped_names(model, optimizer) == [(0.05, all_names - skip), (0.0, skip)]
    assert ("embeddings.weight" in skip) == (not decay_embeddings)
    assert "layers.0.attn.A_log" in skip and "layers.0.attn.q_proj.weight" not in skip


def test_hyperparameters_and_fused_adamw_on_cpu():
    model = tiny_model("transformer", num_heads=4)
    config = parse_args(["--optimizer.lr", "3e-4", "--optimizer.eps", "1e-15", "--optimizer.beta1", "0.8",
                         "--optimizer.beta2", "0.99"])  # fmt: skip
    optimizers = build_optimizers([model], config)
    (optimizer,) = optimizers
    assert isinstance(optimizer, torch.optim.AdamW)
    defaults = optimizer.defaults
    assert (defaults["lr"], defaults["eps"], defaults["betas"], defaults["fused"]) == (
        3e-4,
        1e-15,
        (0.8, 0.99),
        True,
    )
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    before = model.embeddings.weight.detach().clone()
    optimizers.step()  # the fused CPU kernel runs (torch >= 2.4)
    assert not torch.equal(before, model.embeddings.weight)


def test_state_round_trip_keeps_both_groups():
    model = tiny_model("transformer", num_heads=4)
    config = parse_args(["--optimizer.no-decay-embeddings"])
    optimizers = build_optimizers([model], config)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizers.step()
    state = optimizers.state_dict()  # flattened per parameter, as checkpoints store it
    model.zero_grad(set_to_none=True)  # as in a fresh run (torch only initialises state for grad-free params)
    fresh = build_optimizers(
        [model], parse_args(["--optimizer.no-decay-embeddings", "--optimizer.lr", "0.5"])
    )
    fresh.load_state_dict(state)
    assert grouped_names(model, fresh.optimizers[0]) == grouped_names(model, optimizers.optimizers[0])
    assert [g["lr"] for g in fresh.optimizers[0].param_groups] == [config.optimizer.lr] * 2
    exp_avg = optimizers.optimizers[0].state[model.embeddings.weight]["exp_avg"]
    torch.testing.assert_close(fresh.optimizers[0].state[model.embeddings.weight]["exp_avg"], exp_avg)


def test_param_groups_leave_out_frozen_and_empty_groups():
    model = torch.nn.Linear(4, 4, bias=False)
    groups = param_groups(model, 0.1)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    model.weight.requires_grad_(False)
    assert param_groups(model, 0.1) == []
