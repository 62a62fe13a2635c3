"""flame's LogLinearMamba2 layer on the GPU (FLA's chunked log-linear Triton op, flame's short convolution) and FLA's
own training path of the same weights (its Triton convolution and gated RMSNorm), against the layer in float64 on
the CPU (FLA's PyTorch reference of the op: tests/models/layers/test_fla_log_linear_mamba2.py's): float32 without
TF32, output and every gradient within 1e-4 of each tensor's largest value (float32 rounding; a wrong kernel or a
document reading its neighbour differs at order one). The op needs a power-of-two head_dim and a state_size that
is a multiple of 64."""

import copy

import pytest
import torch

from tests.models.layers.packed_documents import assert_packed_equals_alone
from tests.models.layers.test_fla_log_linear_mamba2 import layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = {"hidden_size": 32, "num_heads": 2, "head_dim": 16, "state_size": 64, "expand": 1}
LIMIT = 1e-4


@pytest.mark.parametrize("path", ["fla", "flame"])
def test_layer_on_the_gpu_equals_the_float64_layer(path, exact_float32, fla_tilelang_off):
    reference = layer(**SHAPE)
    gpu = copy.deepcopy(reference).float().cuda()
    x = torch.randn(2, 301, SHAPE["hidden_size"], dtype=torch.float64)
    grad = torch.randn_like(x)
    results = []
    for module, device, dtype in ((reference, "cpu", torch.float64), (gpu, "cuda", torch.float32)):
        leaf = x.detach().to(device, dtype).requires_grad_()
        forward = module.sequence_forward if module is gpu and path == "flame" else module
        out = forward(leaf)[0]
        out.backward(grad.to(device, dtype))
        results.append(
            {"output": out, "input": leaf.grad, **{n: p.grad for n, p in module.named_parameters()}}
        )
    for name, expected in results[0].items():
        difference = (results[1][name].double().cpu() - expected).abs().max() / expected.abs().max()
        assert difference <= LIMIT, f"{name}: {difference:.1e} of the largest value"


def test_packed_documents_on_the_gpu_equal_each_document_alone(exact_float32, fla_tilelang_off):
    reference = layer(**SHAPE)
    gpu = copy.deepcopy(reference).float().cuda()
    assert_packed_equals_alone(gpu, SHAPE["hidden_size"], limit=LIMIT, reference=reference)
