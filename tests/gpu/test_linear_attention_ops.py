"""GatedDeltaNet and DeltaNet ops on the GPU (FLA's Triton kernels, flame's Hopper backward where needed)
against flame's float32 PyTorch path: outputs, final states and every input gradient.

Inputs are rounded to the kernel's dtype first; the reference runs in float32 on exactly those values. In
float16 the limits are FLA's own test ratios for these ops (FLA tests/ops/test_gated_delta.py: o/ht 0.005,
dq/dk/dv/dh0 0.008, dbeta/dg 0.02) on the relative RMS error ||x - ref|| / ||ref||; bfloat16 (what training
uses) keeps 3 fewer mantissa bits, so its limits are twice those.
"""

import pytest
import torch
import torch.nn.functional as F

from flame.ops.delta_rule import chunk_delta_rule
from flame.ops.gated_delta_rule import chunk_gated_delta_rule

RATIOS = {
    "o": 0.005,
    "ht": 0.005,
    "dq": 0.008,
    "dk": 0.008,
    "dv": 0.008,
    "dh0": 0.008,
    "dbeta": 0.02,
    "dg": 0.02,
}


def err_ratio(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return ((ref - out).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8)).item()


DTYPE_FACTOR = {torch.float16: 1.0, torch.bfloat16: 2.0}


def check_all(case: str, dtype, outputs, reference) -> None:
    """Print every ratio of a case on one line, then assert them all."""
    ratios = {name: err_ratio(reference[name], outputs[name].cpu()) for name in reference}
    limits = {name: RATIOS[name] * DTYPE_FACTOR[dtype] for name in reference}
    print(f"{case} {str(dtype)[6:]}: " + " ".join(f"{n} {r:.5f}/{limits[n]:.3f}" for n, r in ratios.items()))
    for name in reference:
        assert torch.isfinite(outputs[name]).all(), f"{name} has non-finite values"
        assert ratios[name] < limits[name], f"{name}: relative RMS error {ratios[name]:.5f} >= {limits[name]}"


def make_inputs(gated: bool, head_dim: int, num_heads: int, num_v_heads: int, lengths, neg_eigval: bool):
    torch.manual_seed(42)
    total = sum(lengths)
    varlen = len(lengths) > 1
    batch, seq_len = (1, total) if varlen else (2, total)
    n_states = len(lengths) if varlen else batch
    dev = "cuda"
    q = torch.randn(batch, seq_len, num_heads, head_dim, device=dev)
    k = torch.randn(batch, seq_len, num_heads, head_dim, device=dev)
    v = torch.randn(batch, seq_len, num_v_heads, head_dim, device=dev)
    beta = torch.rand(batch, seq_len, num_v_heads, device=dev) * (2 if neg_eigval else 1)
    g = F.logsigmoid(torch.randn(batch, seq_len, num_v_heads, device=dev)) if gated else None
    h0 = torch.randn(n_states, num_v_heads, head_dim, head_dim, device=dev)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev) if varlen else None
    return q, k, v, g, beta, h0, cu_seqlens


def run(op, q, k, v, g, beta, h0, cu_seqlens, do, dht, round_to, dtype, device):
    """Outputs and gradients; q, k, v, beta are first rounded to ``round_to``, then cast to ``dtype``."""
    leaves = [
        x.detach().to(round_to).to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v, beta)
    ]
    h0 = h0.detach().to(device=device).requires_grad_()  # states stay float32, as in FLA
    g_leaf = g.detach().to(device=device).requires_grad_() if g is not None else None
    cu = cu_seqlens.to(device) if cu_seqlens is not None else None
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    if g is not None:
        o, ht = op(leaves[0], leaves[1], leaves[2], g_leaf, leaves[3], **kwargs)
    else:
        o, ht = op(leaves[0], leaves[1], leaves[2], leaves[3], **kwargs)
    ((o.float() * do.to(device)).sum() + (ht.float() * dht.to(device)).sum()).backward()
    results = {"o": o, "ht": ht, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    results.update({"dbeta": leaves[3].grad, "dh0": h0.grad})
    if g_leaf is not None:
        results["dg"] = g_leaf.grad
    return results


CASES = [
    # head_dim, heads, value heads, lengths (several = packed with cu_seqlens), negative eigenvalues
    (64, 4, 4, (500,), False),
    (128, 2, 4, (333,), True),
    (256, 2, 2, (300,), False),
    (64, 2, 2, (15, 256, 500, 229), True),
    (128, 2, 4, (100, 300, 129, 48), False),
    (256, 1, 2, (63, 200, 37), True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "num_heads", "num_v_heads", "lengths", "neg_eigval"), CASES)
def test_gated_delta_rule_cuda_matches_torch(head_dim, num_heads, num_v_heads, lengths, neg_eigval, dtype):
    q, k, v, g, beta, h0, cu = make_inputs(True, head_dim, num_heads, num_v_heads, lengths, neg_eigval)
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    outputs = run(chunk_gated_delta_rule, q, k, v, g, beta, h0, cu, do, dht, dtype, dtype, "cuda")
    reference = run(chunk_gated_delta_rule, q, k, v, g, beta, h0, cu, do, dht, dtype, torch.float32, "cpu")
    check_all(
        f"gdn D{head_dim} H{num_heads} HV{num_v_heads} {lengths} neg={neg_eigval}", dtype, outputs, reference
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "num_heads", "num_v_heads", "lengths", "neg_eigval"),
                         [c for c in CASES if c[1] == c[2]])  # fmt: skip
def test_delta_rule_cuda_matches_torch(head_dim, num_heads, num_v_heads, lengths, neg_eigval, dtype):
    q, k, v, _, beta, h0, cu = make_inputs(False, head_dim, num_heads, num_v_heads, lengths, neg_eigval)
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    outputs = run(chunk_delta_rule, q, k, v, None, beta, h0, cu, do, dht, dtype, dtype, "cuda")
    reference = run(chunk_delta_rule, q, k, v, None, beta, h0, cu, do, dht, dtype, torch.float32, "cpu")
    check_all(f"delta D{head_dim} H{num_heads} {lengths} neg={neg_eigval}", dtype, outputs, reference)
