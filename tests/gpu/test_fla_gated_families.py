"""FLA's ops that call FLA's gated chunk_bwd_dqkwg besides GatedDeltaNet's, trained where FLA refuses that
backward (Hopper with Triton 3.4-3.7.0, FLA issue 640): the trainer's prepare_gpu_kernels registers flame's kernel
with FLA, and Comba's and the preconditioned gated delta rule's chunked ops (the comba and precond_gated_deltanet
families) then give outputs and gradients equal to FLA's naive recurrent PyTorch reference. MoM calls GatedDeltaNet's
op, tested in test_fla_library.py.

bf16 inputs against the float32 reference on the same (rounded) values: relative RMS limit 0.01, as for flame's
dqkwg kernel alone (test_dqkwg_triton.py); a wrong or missing backward gives errors of order one or FLA's refusal.
"""

import pytest
import torch
import torch.nn.functional as F

from flame.train.model_parts import prepare_gpu_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LIMIT = 0.01
B, T, H, K, V = 2, 300, 2, 64, 64


def relative_rms(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.double(), reference.double()
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def outputs_and_grads(op, inputs: list[torch.Tensor], dtype: torch.dtype, **kwargs) -> list[torch.Tensor]:
    """The op's output and its inputs' gradients for a fixed random output gradient, from ``dtype`` copies."""
    copies = leaves(*(t.to(dtype) for t in inputs))
    out = op(*copies, **kwargs)[0]
    grad = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(1), device="cuda")
    out.float().backward(grad)
    return [out.float(), *(c.grad.float() for c in copies)]


def assert_close(ours: list[torch.Tensor], reference: list[torch.Tensor], names: list[str]) -> None:
    errors = {name: relative_rms(a, b) for name, a, b in zip(names, ours, reference, strict=True)}
    print({name: f"{e:.1e}" for name, e in errors.items()})
    assert all(e <= LIMIT for e in errors.values()), errors


def test_comba_chunk_trains_and_matches_the_naive_reference():
    from fla.ops.comba import chunk_comba, naive_recurrent_comba

    prepare_gpu_kernels(torch.device("cuda", torch.cuda.current_device()))
    generator = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    q, v = randn(B, T, H, K), randn(B, T, H, V)
    k, p = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
    g = F.logsigmoid(randn(B, T, H))
    beta = randn(B, T, H).sigmoid()
    inputs = [t.to(torch.bfloat16).float() for t in (q, k, v, p, g, beta)]  # both sides see the same values

    def chunk(q, k, v, p, g, beta):
        return chunk_comba(q, k, v, p, g, beta)

    def naive(q, k, v, p, g, beta):
        return naive_recurrent_comba(q, k, v, p, beta, g)

    ours = outputs_and_grads(chunk, inputs, torch.bfloat16)
    reference = outputs_and_grads(naive, inputs, torch.float32)
    assert_close(ours, reference, ["o", "dq", "dk", "dv", "dp", "dg", "dbeta"])


def test_precond_gated_delta_rule_chunk_trains_and_matches_the_naive_reference():
    from fla.ops.precond_gated_delta_rule import (
        chunk_precond_gated_delta_rule,
        naive_recurrent_precond_gated_delta_rule,
    )

    prepare_gpu_kernels(torch.device("cuda", torch.cuda.current_device()))
    generator = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, 2 * H, V)  # grouped value heads
    g_atk, g = F.logsigmoid(randn(B, T, H)), F.logsigmoid(randn(B, T, 2 * H))
    beta_atk, beta = randn(B, T, H).sigmoid(), randn(B, T, 2 * H).sigmoid()
    inputs = [t.to(torch.bfloat16).float() for t in (q, k, v, g_atk, g, beta_atk, beta)]

    ours = outputs_and_grads(chunk_precond_gated_delta_rule, inputs, torch.bfloat16)
    reference = outputs_and_grads(naive_recurrent_precond_gated_delta_rule, inputs, torch.float32)
    assert_close(ours, reference, ["o", "dq", "dk", "dv", "dg_atk", "dg", "dbeta_atk", "dbeta"])
