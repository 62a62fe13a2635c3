"""flame's Triton selective scan on the GPU against the token-by-token recurrence in float64 on the CPU (the
interpreted CPU tests cover odd sizes; this one the compiled kernels at a layer's size: 2 x 300 tokens, 200
channels, 16 states, crossing the 64-token chunks and 32-channel blocks), and a bf16 training step of mamba through
flame (FLA's Mamba layers on flame's scan). Tolerances as in tests/ops/interpreted/test_selective_scan_triton.py:
float32 rtol 1e-5 with atol 1e-5 x max |reference|; bfloat16 one ulp (2^-7) with atol 1e-2 x max |reference|."""

import pytest
import torch

from flame.models import build_model, model_args_from_dict
from flame.ops.selective_scan import selective_scan_recurrent
from flame.ops.selective_scan.triton_kernel import selective_scan_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_the_float64_recurrence(dtype):
    generator = torch.Generator().manual_seed(0)
    batch, length, dim, states = 2, 300, 200, 16
    u = torch.randn(batch, length, dim, generator=generator, dtype=torch.float64)
    delta = torch.nn.functional.softplus(
        torch.randn(batch, length, dim, generator=generator, dtype=torch.float64)
    )
    A = -torch.rand(dim, states, generator=generator, dtype=torch.float64) * 4 - 0.1
    B, C = (torch.randn(batch, length, states, generator=generator, dtype=torch.float64) for _ in range(2))
    dy = torch.randn(batch, length, dim, generator=generator, dtype=torch.float64)
    args = [u.to(dtype), delta.to(dtype), A.float(), B.to(dtype), C.to(dtype)]
    results = []
    for scan, device, inputs, grad in ((selective_scan_triton, "cuda", args, dy.to(dtype)),
                                       (selective_scan_recurrent, "cpu", [t.double() for t in args], dy)):  # fmt: skip
        leaves = [t.to(device).requires_grad_() for t in inputs]
        y, last = scan(*leaves)
        y.backward(grad.to(device))
        results.append([y, last, *(t.grad for t in leaves)])
    rtol, atol = TOLERANCES[dtype]
    for name, ours, want in zip(("y", "last", "u", "delta", "A", "B", "C"), *results):
        torch.testing.assert_close(
            ours.cpu().double(), want, rtol=rtol, atol=atol * want.abs().max().item(), msg=name
        )


def test_mamba_trains_a_bf16_step_on_flames_scan():
    args, _ = model_args_from_dict({"model_type": "mamba", "vocab_size": 512, "hidden_size": 128,
                                    "num_hidden_layers": 2, "state_size": 16})  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    model = model.to(torch.bfloat16).train()
    input_ids = torch.randint(0, 512, (2, 300), device="cuda")
    logits = model(input_ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
