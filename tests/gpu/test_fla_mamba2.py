"""flame's Mamba2 layer (FLA's class on flame.ops.ssd: FLA's simple-GLA Triton kernel) on the GPU, with FLA's Triton
SiLU and gated RMSNorm, against the same layer in float64 on the CPU with PyTorch's
(tests/models/layers/test_fla_mamba2.py's): float32 without TF32 and Triton's kernels only, output and gradients
within 1e-4 of each tensor's largest value (float32 rounding; a wrong kernel differs at order one)."""

import copy

import pytest
import torch

from tests.models.layers.packed_documents import assert_packed_equals_alone
from tests.models.layers.test_fla_mamba2 import GatedRMSNorm, layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_layer_on_the_gpu_equals_the_float64_layer(exact_float32, fla_tilelang_off):
    _, reference = layers(n_groups=2)
    _, gpu = layers(n_groups=2)
    from fla.layers.mamba2 import Mamba2

    triton_layer = Mamba2(hidden_size=24, head_dim=8, state_size=5, expand=2, n_groups=2, chunk_size=16)
    gpu.act, gpu.norm = triton_layer.act, triton_layer.norm  # FLA's Triton SiLU and gated RMSNorm
    with torch.no_grad():
        gpu.norm.weight.copy_(reference.norm.weight)
    assert isinstance(reference.norm, GatedRMSNorm) and not isinstance(gpu.norm, GatedRMSNorm)
    gpu = gpu.float().cuda()
    x = torch.randn(2, 301, 24, dtype=torch.float64)
    grad = torch.randn(2, 301, 24, dtype=torch.float64)
    results = []
    for layer, device, dtype in ((reference, "cpu", torch.float64), (gpu, "cuda", torch.float32)):
        leaf = x.detach().to(device, dtype).requires_grad_()  # a leaf on each device
        out = layer(leaf)[0]
        out.backward(grad.to(device, dtype))
        results.append(
            {"output": out, "input": leaf.grad, **{n: p.grad for n, p in layer.named_parameters()}}
        )
    for name, expected in results[0].items():
        ours = results[1][name].double().cpu()
        assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max(), name


def test_packed_documents_on_the_gpu_equal_each_document_alone(exact_float32, fla_tilelang_off):
    """cu_seqlens on the GPU (flame.ops.ssd hands the boundaries to FLA's chunk_simple_gla): one row of three
    documents gives, in float32, the output and gradients of the documents run one by one in float64 on the CPU,
    within 1e-4 of the largest value."""
    _, reference = layers(n_groups=2)
    gpu = copy.deepcopy(reference).float().cuda()
    assert_packed_equals_alone(gpu, 24, limit=1e-4, reference=reference)
