"""flame's PyTorch version of FLA's rotary embedding (flame/ops/rotary.py) against FLA's own PyTorch reference
(``fla.modules.rotary.ops.rotary_embedding_ref``, which takes the cos/sin rows of its positions), applied per
sequence and document on odd sizes: partial rotary dims, interleaved pairs, offsets (one number, one per sequence,
negative under left padding), packed documents. float64 agrees to 1e-12; float32 to 1e-6; bfloat16 to one ulp (both
round the float32 value once). FLA's Triton kernel is compared on the GPU (tests/gpu/test_fla_compiled_blocks.py).
"""

import pytest
import torch

from flame.ops.rotary import rotary_embedding

fla_rotary = pytest.importorskip("fla.modules.rotary.ops")

TOL = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1e-6, "atol": 1e-6},
    torch.bfloat16: {"rtol": 2**-8, "atol": 1e-6},
}


def tables(positions: int, half: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def reference(x, cos, sin, interleaved, positions):
    """FLA's reference per row of ``positions`` [B, T] (zeros in the rotated channels outside the table)."""
    out = torch.empty_like(x)
    rotary = 2 * cos.shape[-1]
    for b in range(x.shape[0]):
        inside = (positions[b] >= 0) & (positions[b] < cos.shape[0])
        rows = positions[b].clamp(0, cos.shape[0] - 1)
        out[b] = fla_rotary.rotary_embedding_ref(
            x[b].double(), cos[rows].double(), sin[rows].double(), interleaved
        ).to(x.dtype)
        out[b, ~inside, :, :rotary] = 0
    return out


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["none", "int", "per_sequence"])
def test_batched_sequences_match_flas_reference(dtype, interleaved, offsets):
    batch, tokens, heads, dim, half = 3, 37, 5, 24, 8  # rotary dim 16 of 24
    x = randn(batch, tokens, heads, dim, dtype=dtype, seed=0)
    cos, sin = tables(45, half, dtype)
    shift = {"none": 0, "int": 5, "per_sequence": torch.tensor([0, 8, -3])}[offsets]
    positions = torch.arange(tokens)[None].expand(batch, tokens)
    positions = positions + (shift[:, None] if isinstance(shift, torch.Tensor) else shift)
    out = rotary_embedding(x, cos, sin, interleaved=interleaved, seqlen_offsets=shift)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, reference(x, cos, sin, interleaved, positions), **TOL[dtype])
    if offsets == "per_sequence":  # the left-padded rows rotate to zeros; their other channels pass through
        assert out[2, :3, :, : 2 * half].eq(0).all() and out[2, :3, :, 2 * half :].equal(
            x[2, :3, :, 2 * half :]
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_document_offsets", [False, True])
def test_packed_documents_restart_at_their_offsets(dtype, per_document_offsets):
    heads, dim, half = 3, 18, 9
    cu_seqlens = torch.tensor([0, 11, 12, 40, 53])
    x = randn(1, 53, heads, dim, dtype=dtype, seed=1)
    cos, sin = tables(64, half, dtype)
    shift = torch.tensor([0, 4, 7, 2]) if per_document_offsets else 0
    out = rotary_embedding(x, cos, sin, seqlen_offsets=shift, cu_seqlens=cu_seqlens)
    positions = torch.cat([
        torch.arange(end - start) + (shift[i] if per_document_offsets else 0)
        for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    ])[None]  # fmt: skip
    torch.testing.assert_close(out, reference(x, cos, sin, False, positions), **TOL[dtype])


def test_gradient_passes_gradcheck_and_inplace_writes_the_input():
    x = randn(2, 13, 3, 10, dtype=torch.float64, seed=2).requires_grad_()
    cos, sin = tables(20, 4, torch.float64)
    torch.autograd.gradcheck(lambda t: rotary_embedding(t, cos, sin, interleaved=True), (x,))
    y = x.detach().clone()
    out = rotary_embedding(y, cos, sin, inplace=True)
    assert out.data_ptr() == y.data_ptr()
    torch.testing.assert_close(y, rotary_embedding(x.detach(), cos, sin), rtol=0, atol=0)
