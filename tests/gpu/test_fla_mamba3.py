"""flame's Mamba3 layer (FLA's class on flame.ops.mamba3: Mamba-2's scan on FLA's simple-GLA Triton kernel) on the
GPU in float32 without TF32 and Triton's kernels only, with FLA's Triton RMSNormGated for B and C, against the same
layer computed token by token in float64 on the CPU with PyTorch's norm (tests/models/layers/test_fla_mamba3.py's):
output and gradients within 1e-4 of each tensor's largest value (float32 rounding; a wrong kernel call differs at
order one)."""

import copy

import pytest
import torch

from tests.models.layers.packed_documents import assert_packed_equals_alone
from tests.models.layers.test_fla_mamba3 import MIMO, ReferenceRMSNorm, layer, token_by_token

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "options",
    [{}, {"n_groups": 2, "rope_fraction": 1.0}, {"is_mimo": True, "mimo_rank": 3}],
    ids=["siso", "two_groups", "mimo"],
)
def test_layer_on_the_gpu_equals_the_float64_token_by_token_layer(options, exact_float32, fla_tilelang_off):
    reference = layer(**options)
    gpu = copy.deepcopy(reference)
    gpu.B_norm, gpu.C_norm = gpu.B_norm.norm, gpu.C_norm.norm  # FLA's Triton RMSNormGated
    assert isinstance(reference.B_norm, ReferenceRMSNorm) and not isinstance(gpu.B_norm, ReferenceRMSNorm)
    gpu = gpu.float().cuda()
    x = torch.randn(2, 301, 24, dtype=torch.float64)
    grad = torch.randn(2, 301, 24, dtype=torch.float64)
    results = []
    for forward, module, device, dtype in (
        (token_by_token, reference, "cpu", torch.float64),
        (lambda m, h: m(h)[0], gpu, "cuda", torch.float32),
    ):
        leaf = x.detach().to(device, dtype).requires_grad_()
        out = forward(module, leaf)
        out.backward(grad.to(device, dtype))
        named = {n.replace(".norm.", "."): p.grad for n, p in module.named_parameters()}
        results.append({"output": out, "input": leaf.grad, **named})
    assert results[0].keys() == results[1].keys()
    for name, expected in results[0].items():
        ours = results[1][name].double().cpu()
        assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max(), name


@pytest.mark.parametrize("options", [{}, MIMO], ids=["siso", "mimo"])
def test_packed_documents_on_the_gpu_equal_each_document_alone(options, exact_float32, fla_tilelang_off):
    """cu_seqlens on the GPU (Mamba-2's scan hands the boundaries to FLA's chunk_simple_gla; the angles' sum and
    the per-token terms restart at each document): one row of three documents gives, in float32, the output and
    gradients of the documents run one by one in float64 on the CPU, within 1e-4 of the largest value."""
    reference = layer(**options)
    gpu = copy.deepcopy(reference).float().cuda()
    assert_packed_equals_alone(gpu, 24, limit=1e-4, reference=reference)
