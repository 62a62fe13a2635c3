"""flame.ops.selective_scan on the CPU: the token-by-token recurrence against the scan's closed form in float64,
h[t] = sum_{s <= t} exp(A sum_{r = s+1}^{t} delta[r]) delta[s] B[s] u[s], y[t] = C[t] . h[t], written with
cumulative sums over every pair of tokens (independent of the recurrence's order of operations); the dispatch runs it
on the CPU. Odd sizes (batch 2, 13 tokens, 7 channels, 3 states)."""

import torch

from flame.ops import dispatch
from flame.ops.selective_scan import selective_scan, selective_scan_recurrent


def inputs(dtype=torch.float64, batch=2, length=13, dim=7, states=3):
    generator = torch.Generator().manual_seed(0)
    u = torch.randn(batch, length, dim, generator=generator, dtype=dtype)
    delta = torch.nn.functional.softplus(torch.randn(batch, length, dim, generator=generator, dtype=dtype))
    A = -torch.rand(dim, states, generator=generator, dtype=dtype) * 2 - 0.1
    B, C = (torch.randn(batch, length, states, generator=generator, dtype=dtype) for _ in range(2))
    return u, delta, A, B, C


def closed_form(u, delta, A, B, C):
    cumulative = delta.cumsum(1)  # [b, t, d]
    gaps = cumulative[:, :, None, :] - cumulative[:, None, :, :]  # [b, t, s, d]: sum of delta over (s, t]
    causal = torch.ones(u.shape[1], u.shape[1], dtype=torch.bool).tril()[None, :, :, None, None]
    decay = torch.exp(gaps[..., None] * A).where(causal, 0.0)  # [b, t, s, d, n]
    inputs = (delta * u)[:, None, :, :, None] * B[:, None, :, None, :]  # [b, 1, s, d, n]
    states = (decay * inputs).sum(2)  # [b, t, d, n]
    return torch.einsum("btdn,btn->btd", states, C), states[:, -1]


def test_recurrence_equals_the_closed_form_in_float64():
    args = inputs()
    y, last = selective_scan_recurrent(*args)
    want_y, want_last = closed_form(*args)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, want_last, rtol=1e-12, atol=1e-12)


def test_low_precision_inputs_scan_in_float32_and_return_the_inputs_dtype():
    u, delta, A, B, C = inputs(torch.float32)
    y, last = selective_scan_recurrent(u.bfloat16(), delta, A, B, C)
    assert y.dtype == torch.bfloat16 and last.dtype == torch.float32
    reference, _ = selective_scan_recurrent(u.bfloat16().float(), delta, A, B, C)
    torch.testing.assert_close(y, reference.bfloat16(), rtol=0, atol=0)


def test_the_cpu_runs_the_recurrence_and_cuda_the_triton_kernel():
    args = inputs()
    assert dispatch.backend_names("selective_scan") == ("triton",)
    torch.testing.assert_close(selective_scan(*args)[0], selective_scan_recurrent(*args)[0], rtol=0, atol=0)


def test_the_triton_kernels_compile_for_hopper():
    """Triton compiles flame's forward and backward kernels for an sm_90 target without a GPU (ptxas ships with
    Triton), for bfloat16 and float32 inputs at a layer's block sizes: a kernel that does not build fails here
    rather than at a GPU run's first step. Their results are tests/ops/interpreted's and tests/gpu's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flame.ops.selective_scan import triton_kernel as kernels

    def signature(kernel, dtype):
        types = {}
        for name in kernel.arg_names:
            if name in ("CHUNK", "BLOCK_D", "BLOCK_N"):
                types[name] = "constexpr"
            elif name.startswith("stride_"):
                types[name] = "i64"
            elif name in ("T", "D", "N", "NUM_CHUNKS"):
                types[name] = "i32"
            else:  # inputs in the activations' dtype; A, states and gradients' buffers in float32
                types[name] = f"*{dtype}" if name in ("U", "DELTA", "B", "C", "Y", "DY") else "*fp32"
        return types

    for kernel in (kernels._fwd_kernel, kernels._bwd_kernel):
        for dtype in ("bf16", "fp32"):
            source = ASTSource(
                kernel,
                signature(kernel, dtype),
                constexprs={"CHUNK": kernels.TILES.chunk, "BLOCK_D": kernels.TILES.block_d, "BLOCK_N": 16},
            )
            compiled = triton.compile(
                source, target=GPUTarget("cuda", 90, 32), options={"num_warps": kernels.TILES.warps}
            )
            assert compiled.asm["cubin"]
