"""fuse_linear_cross_entropy in an FLA config: flame's generic model hands its decoder's output to flame's fused loss,
whose lm_head computes the loss chunk by chunk without the batch's logits. On FLA's transformer class (its SwiGLU
kernel replaced by the same function in PyTorch, so that it runs on the CPU), float64: the fused objective's loss
and every gradient equal the unfused objective's on the class's logits (rtol = atol = 1e-10), with z-loss, the
L2-warp and ignored tokens; the trainer's objective is fused from the config."""

import pytest
import torch
import torch.nn.functional as F

from flame.config import parse_args
from flame.loss import IGNORE_INDEX
from flame.models import build_model, model_args_from_dict
from flame.models.common.decoder import LMHead, fuses_linear_cross_entropy
from flame.train.objective import LanguageModelObjective

CONFIG = {"model_type": "transformer", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
          "fuse_norm": False, "fuse_swiglu": False, "fuse_cross_entropy": False,
          "fuse_linear_cross_entropy": True}  # fmt: skip


@pytest.fixture
def swiglu_in_pytorch(monkeypatch):
    import fla.modules.mlp

    monkeypatch.setattr(fla.modules.mlp, "swiglu", lambda gate, up: F.silu(gate) * up)


def fla_transformer(**overrides):
    args, _ = model_args_from_dict({**CONFIG, **overrides}, impl="fla")
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model.double()


@pytest.mark.parametrize("tied", [False, True])
def test_fused_objective_gives_the_unfused_loss_and_gradients(swiglu_in_pytorch, tied):
    model = fla_transformer(tie_word_embeddings=tied)
    assert fuses_linear_cross_entropy(model) and type(model).__module__ == "flame.models.generic.model"
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    job_config = parse_args(["--training.z_loss", "1e-3"])
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (2, 19), generator=generator)
    labels = torch.randint(0, 97, (2, 19), generator=generator)
    labels[0, :5] = labels[1, 11:] = IGNORE_INDEX
    results = []
    for fused in (False, True):
        objective = LanguageModelObjective(job_config, fused=fused, l2warp=1e-2)
        model.zero_grad()
        output = model(tokens, return_hidden=fused)
        assert output.shape[-1] == (32 if fused else 97)  # no logits on the fused path
        loss, metrics = objective(output, labels, {"input": tokens}, model.lm_head if fused else None)
        loss.backward()
        results.append((loss, metrics, {name: p.grad.clone() for name, p in model.named_parameters()}))
    (loss, metrics, grads), (fused_loss, fused_metrics, fused_grads) = results
    tight = {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(fused_loss, loss, **tight)
    torch.testing.assert_close(fused_metrics["loss"], metrics["loss"].detach(), **tight)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, **tight, msg=lambda m, name=name: f"{name}: {m}")


def test_the_objective_is_fused_from_the_config_which_still_builds_flas_class(monkeypatch):
    import fla.layers.attn
    from transformers import AutoConfig, AutoModelForCausalLM

    from flame.train.objective import build_objective

    args, _ = model_args_from_dict(CONFIG, impl="fla")
    assert args.fuse_linear_cross_entropy and build_objective(args, None, parse_args([])).fused
    with torch.device("meta"):
        assert isinstance(build_model(args).lm_head, LMHead)
        # the config flame records and exports is FLA's own: its class builds from it, with its plain lm_head
        values = {k: v for k, v in args.hf_dict().items() if k != "model_type"}
        monkeypatch.setattr(fla.layers.attn, "flash_attn_func", object())  # FLA's layer checks the name only
        fla_model = AutoModelForCausalLM.from_config(AutoConfig.for_model("transformer", **values))
    assert type(fla_model.lm_head) is torch.nn.Linear and fla_model.config.fuse_linear_cross_entropy
