"""FLA's ops that call FLA's gated chunk_bwd_dqkwg besides GatedDeltaNet's, trained where FLA refuses that
backward (Hopper with Triton 3.4-3.7.0, FLA issue 640): the trainer's prepare_gpu_kernels registers flame's kernel
with FLA, and Comba's and the preconditioned gated delta rule's chunked ops (the comba and precond_gated_deltanet
families) then give outputs and gradients equal to a recurrent PyTorch reference. MoM calls GatedDeltaNet's op,
tested in test_fla_library.py.

Comba's reference is this file's own recurrence: FLA's naive_recurrent_comba lets p read the state after the step's
decay, while FLA's chunked and fused recurrent ops (the ones its layer trains with, and FLA's own tests' chunked
reference) read it before; the two differ by about 10% in float64. The CPU test checks the recurrence against FLA's
naive_chunk_comba. The preconditioned rule's reference is FLA's naive_recurrent_precond_gated_delta_rule.

bf16 inputs against the float32 reference on the same (rounded) values: relative RMS limit 0.01, as for flame's
dqkwg kernel alone (test_dqkwg_triton.py); a wrong or missing backward gives errors of order one or FLA's refusal.
"""

import pytest
import torch
import torch.nn.functional as F

from flame.train.kernels import prepare_gpu_kernels

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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


def recurrent_comba(q, k, v, p, g, beta, scale: float | None = None):
    """Comba as FLA's chunked op computes it, one step at a time: u_t = beta_t (v_t - S_{t-1}^T p_t),
    S_t = exp(g_t) S_{t-1} + k_t u_t^T, o_t = scale S_t^T q_t; inputs [B, T, H, *], computed in their dtype."""
    batch, steps, heads, key_dim = k.shape
    scale = key_dim**-0.5 if scale is None else scale
    state = k.new_zeros(batch, heads, key_dim, v.shape[-1])
    outputs = []
    for t in range(steps):
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", p[:, t], state))
        state = g[:, t].exp()[..., None, None] * state + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1), state


def test_comba_recurrence_is_fla_chunked_comba():
    """On the CPU in float64 against FLA's naive_chunk_comba (whose decay masks it builds in float32: hence 1e-5)."""
    from fla.ops.comba.naive import naive_chunk_comba

    torch.manual_seed(0)
    b, t, h, k, v = 2, 77, 3, 16, 12
    q = torch.randn(b, t, h, k, dtype=torch.float64)
    keys, p = (F.normalize(torch.randn(b, t, h, k, dtype=torch.float64), dim=-1) for _ in range(2))
    values = torch.randn(b, t, h, v, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(b, t, h, dtype=torch.float64))
    beta = torch.rand(b, t, h, dtype=torch.float64)
    ours, state = recurrent_comba(q, keys, values, p, g, beta)
    reference, final = naive_chunk_comba(q, keys, values, p, g, beta, output_final_state=True)
    assert relative_rms(ours, reference) < 1e-5 and relative_rms(state, final) < 1e-5


@needs_cuda
def test_comba_chunk_trains_and_matches_the_recurrent_reference():
    from fla.ops.comba import chunk_comba

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

    ours = outputs_and_grads(chunk, inputs, torch.bfloat16)
    reference = outputs_and_grads(recurrent_comba, inputs, torch.float32)
    assert_close(ours, reference, ["o", "dq", "dk", "dv", "dp", "dg", "dbeta"])


@needs_cuda
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
