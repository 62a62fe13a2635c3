"""FLA families on the GPU with the loss terms flame computes in place of their classes' own loss: with
fuse_linear_cross_entropy (GLA; MoM, whose router load balancing comes from its decoder's output then) the fused
objective's loss and gradients equal the unfused objective's on the class's logits, and MoM's step adds its class's
load balancing. float32 without TF32 (tests/gpu/conftest.py's exact_float32): the same decoder forward, the loss summed in another order (rtol 1e-4,
atol 1e-6 on the gradients)."""

import pytest
import torch

from flame.config import parse_args
from flame.loss import IGNORE_INDEX
from flame.models import build_model, model_args_from_dict
from flame.models.common.decoder import fuses_linear_cross_entropy
from flame.train.kernels import prepare_gpu_kernels
from flame.train.objective import LanguageModelObjective

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 2, "num_heads": 2,
          "fuse_cross_entropy": False, "fuse_linear_cross_entropy": True}  # fmt: skip
FAMILIES = {"gla": {}, "mom": {"num_memories": 4, "topk": 2}}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_objective_gives_the_unfused_gradients(family, exact_float32):
    prepare_gpu_kernels(torch.device("cuda"))
    args, _ = model_args_from_dict({"model_type": family, **SHAPES, **FAMILIES[family]})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    model.init_weights()
    assert fuses_linear_cross_entropy(model)
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 1000, (2, 256), device="cuda", generator=generator)
    labels = torch.randint(0, 1000, (2, 256), device="cuda", generator=generator)
    labels[0, :40] = IGNORE_INDEX
    job_config = parse_args(["--training.z_loss", "1e-4"])
    results = []
    for fused in (False, True):
        objective = LanguageModelObjective(job_config, fused=fused, l2warp=1e-4)
        model.zero_grad()
        output = model(tokens, return_hidden=fused)
        loss, _ = objective(output, labels, {"input": tokens}, model.lm_head if fused else None)
        if family == "mom":
            assert model.auxiliary_loss is not None and model.auxiliary_loss > 0
            loss = loss + model.auxiliary_loss * objective.count(labels)
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (loss, grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(
            fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
