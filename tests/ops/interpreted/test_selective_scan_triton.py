"""flame's Triton selective-scan kernels (flame/ops/selective_scan/triton_kernel.py), run by Triton's interpreter on
the CPU, against the token-by-token recurrence `selective_scan_recurrent` evaluated in float64 on the same (rounded)
inputs, and its gradients by autograd.

Odd sizes: batch 2, 21 tokens (the interpreter's chunks of 8 tokens: 3 chunks, the last ragged, each scanned at
once), 11 channels (blocks of 8, the last ragged), 5 states (a block of 8, padded). y, the last state and the
gradients du, ddelta, dA, dB, dC of one fixed output gradient, compared with torch.testing.assert_close, atol
scaled by the largest |reference value| of each tensor:
- float64: rtol = 1e-12, atol = 1e-12 x max |reference|;
- float32: rtol = 1e-5, atol = 1e-5 x max |reference| (dA, dB and dC are sums over tokens and channels);
- bfloat16 u, delta, B, C and dy with a float32 A: y and the gradients in bfloat16, rounded once from float32 sums:
  rtol = 2^-7 (one bfloat16 ulp), atol = 1e-2 x max |reference|.
"""

import pytest
import torch

from flame.ops.selective_scan import selective_scan_recurrent
from flame.ops.selective_scan import triton_kernel as kernels
from flame.ops.selective_scan.triton_kernel import selective_scan_triton

TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-2)}
NAMES = ("u", "delta", "A", "B", "C")


def inputs(dtype, batch=2, length=21, dim=11, states=5):
    generator = torch.Generator().manual_seed(0)
    u = torch.randn(batch, length, dim, generator=generator, dtype=torch.float64)
    delta = torch.nn.functional.softplus(
        torch.randn(batch, length, dim, generator=generator, dtype=torch.float64)
    )
    A = -torch.rand(dim, states, generator=generator, dtype=torch.float64) * 2 - 0.1
    B, C = (torch.randn(batch, length, states, generator=generator, dtype=torch.float64) for _ in range(2))
    dy = torch.randn(batch, length, dim, generator=generator, dtype=torch.float64)
    a_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    return [u.to(dtype), delta.to(dtype), A.to(a_dtype), B.to(dtype), C.to(dtype)], dy.to(dtype)


def run(scan, args, dy):
    leaves = [t.clone().requires_grad_() for t in args]
    y, last = scan(*leaves)
    y.backward(dy)
    return [y, last, *(t.grad for t in leaves)]


def test_the_interpreter_crosses_chunk_and_block_edges():
    assert kernels.INTERPRETED and kernels.TILES.chunk == 8 and kernels.TILES.block_d == 8


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_and_gradients_equal_the_recurrence(dtype):
    args, dy = inputs(dtype)
    ours = run(selective_scan_triton, args, dy)
    reference = run(selective_scan_recurrent, [t.double() for t in args], dy.double())
    rtol, atol = TOLERANCES[dtype]
    for name, mine, want, given in zip(("y", "last state", *NAMES), ours, reference, [args[0], None, *args]):
        if given is not None:
            assert mine.dtype == given.dtype, name
        torch.testing.assert_close(
            mine.double(), want, rtol=rtol, atol=atol * want.abs().max().item(), msg=name
        )


def test_strided_inputs_and_output_gradient():
    """u and delta as views of one [batch, T, 2D] tensor (row stride 2D), B and C of one [batch, T, 2N] tensor, and
    a transposed output gradient: the kernels read strides, not a contiguous layout."""
    args, dy = inputs(torch.float64)
    u, delta, A, B, C = args
    ud = torch.cat([u, delta], dim=-1)
    bc = torch.cat([B, C], dim=-1)
    strided = [ud[..., :11], ud[..., 11:], A, bc[..., :5], bc[..., 5:]]
    dy_t = dy.transpose(0, 1).contiguous().transpose(0, 1)
    ours = run(selective_scan_triton, strided, dy_t)
    reference = run(selective_scan_recurrent, args, dy)
    for name, mine, want in zip(("y", "last state", *NAMES), ours, reference):
        torch.testing.assert_close(mine, want, rtol=1e-12, atol=1e-12 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_documents_scan_as_each_document_alone(dtype):
    """cu_seqlens over one row of 37 tokens: documents of 6 (inside the first 8-token chunk), 1, 19 (across two
    chunk borders), 0 (empty: a zero state) and 11 tokens (to the row's end, the last chunk ragged). y, each
    document's last state and every gradient equal the recurrence over each document alone, at the tolerances of
    the unpacked test; the row scanned as one document differs."""
    lengths = [6, 1, 19, 0, 11]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    args, dy = inputs(dtype, batch=1, length=sum(lengths))
    ours = run(lambda *t: selective_scan_triton(*t, cu_seqlens=bounds), args, dy)
    reference = run(
        lambda *t: selective_scan_recurrent(*t, cu_seqlens=bounds), [t.double() for t in args], dy.double()
    )
    assert ours[1].shape == (len(lengths), 11, 5) and not ours[1][3].any()
    rtol, atol = TOLERANCES[dtype]
    for name, mine, want in zip(("y", "states", *NAMES), ours, reference, strict=True):
        torch.testing.assert_close(
            mine.double(), want, rtol=rtol, atol=atol * want.abs().max().item(), msg=name
        )
    whole = run(selective_scan_recurrent, [t.double() for t in args], dy.double())
    assert (whole[0][:, 6:] - reference[0][:, 6:]).abs().max() > 1e-3
